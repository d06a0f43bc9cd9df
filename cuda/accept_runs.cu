// Each request's run of accepted drafts; twins: accept_runs and accept_matching_runs in
// cupyspec/spec/accept_runs.py.
//
// Request b owns target rows first_row[b] .. first_row[b+1] - 1: one per draft, then its bonus
// row. It keeps its drafts up to the first whose row did not pass its test and emits the token of
// the row where it stopped (the bonus row when every draft passed). One thread per request.

template <class Passes>
__device__ __forceinline__ void write_run(int b, int num_seqs, const long long* __restrict__ emit_at,
                                          const long long* __restrict__ first_row, Passes passes,
                                          long long* __restrict__ out)
{
    const long long first = first_row[b], bonus = first_row[b + 1] - 1;
    long long row = first;
    while (row < bonus && passes(row)) ++row;
    out[b] = row - first;
    out[num_seqs + b] = emit_at[row];
}

struct PassedFlag {  // the row's test, computed before
    const bool* passed;
    __device__ bool operator()(long long row) const { return passed[row]; }
};

struct MatchesEmitted {  // the row's draft is the token the row emits (greedy rows: its argmax)
    const long long* emit_at;
    const long long* row_draft;
    __device__ bool operator()(long long row) const { return row_draft[row] == emit_at[row]; }
};

extern "C" __global__ void accept_runs(
    const bool* __restrict__ passed,           // [R] the row's draft passed its test (bonus rows: ignored)
    const long long* __restrict__ emit_at,     // [R] the token emitted when a request stops at the row
    const long long* __restrict__ first_row,   // [B+1]
    int num_seqs,
    long long* __restrict__ out)               // [2, B] drafts accepted, then the emitted token
{
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < num_seqs) write_run(b, num_seqs, emit_at, first_row, PassedFlag{passed}, out);
}

extern "C" __global__ void accept_matching_runs(
    const long long* __restrict__ emit_at,     // [R] the token emitted when a request stops at the row
    const long long* __restrict__ drafts_then_bounds,  // [R + B + 1] the draft each row scores, then first_row
    int num_rows,
    int num_seqs,
    long long* __restrict__ out)               // [2, B] drafts accepted, then the emitted token
{
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < num_seqs) {
        write_run(b, num_seqs, emit_at, drafts_then_bounds + num_rows, MatchesEmitted{emit_at, drafts_then_bounds},
                  out);
    }
}
