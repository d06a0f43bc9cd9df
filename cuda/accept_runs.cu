// Each request's run of accepted drafts; twin: accept_runs in cupyspec/spec/accept_runs.py.
//
// Request b owns target rows first_row[b] .. first_row[b+1] - 1: one per draft, then its bonus
// row. It keeps its drafts up to the first whose row did not pass its test and emits the token of
// the row where it stopped (the bonus row when every draft passed). One thread per request.

extern "C" __global__ void accept_runs(
    const bool* __restrict__ passed,           // [R] the row's draft passed its test (bonus rows: ignored)
    const long long* __restrict__ emit_at,     // [R] the token emitted when a request stops at the row
    const long long* __restrict__ first_row,   // [B+1]
    int num_seqs,
    long long* __restrict__ out)               // [2, B] drafts accepted, then the emitted token
{
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= num_seqs) return;
    const long long first = first_row[b], bonus = first_row[b + 1] - 1;
    long long row = first;
    while (row < bonus && passed[row]) ++row;
    out[b] = row - first;
    out[num_seqs + b] = emit_at[row];
}
