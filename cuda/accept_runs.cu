// Each request's run of accepted drafts; twins: accept_runs and greedy_runs in
// cupyspec/spec_decode/verification/accept_runs.py.
//
// Request b owns target rows first_row[b] .. first_row[b+1] - 1: one per draft, then its bonus
// row. It keeps its drafts up to the first whose row did not pass its test and emits the token of
// the row where it stopped (the bonus row when every draft passed).

#include "argmax.cuh"

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

// Greedy rows (twin: greedy_runs): one block per target row takes the row's argmax, the token a
// greedy row emits (cuda/argmax.cuh); the last block to finish then writes every request's run:
// its drafts up to the first that is not its row's argmax, and the argmax of the row where it
// stopped (or every draft, or none, under the accept policy accept_all = 1 or reject_all = 2).
// Request b's drafts are drafts[b, :num_drafts[b]], its rows start after
// num_drafts[c] + 1 rows of each request c before it. A draft ~n < 0 is a placeholder for slots[n]
// (an MTP head's draft still on the device, cupyspec/model/device_tokens.py); the drafts, resolved,
// are written out. With slots, each request's emitted token and accepted drafts also go to
// slots[b * width] and accepted[b], where the next step reads them.
extern "C" __global__ void __launch_bounds__(ARGMAX_MAX_THREADS) greedy_runs(
    const float* __restrict__ x,                          // [R, V] target rows
    long long vocab,
    const long long* __restrict__ drafts_then_counts,     // [B*K] drafts, then num_drafts [B]
    int num_seqs,
    int max_drafts,
    int* __restrict__ slots,                              // [N], read and written when use_slots
    int* __restrict__ accepted,                           // [B], written when use_slots
    int width,
    int use_slots,
    int policy,
    long long* __restrict__ out)  // [2B + B*K + R + 1]: runs [2, B], the drafts [B, K], each row's argmax [R],
                                  // and a counter that is 0 on entry
{
    long long* resolved = out + 2 * (long long)num_seqs;
    long long* tokens = resolved + (long long)num_seqs * max_drafts;
    unsigned int* finished = (unsigned int*)(tokens + gridDim.x);
    const long long token = block_argmax(x + (long long)blockIdx.x * vocab, vocab);
    __shared__ bool last;
    if (threadIdx.x == 0) {
        tokens[blockIdx.x] = token;
        __threadfence();  // the argmax is visible to whichever block counts last
        last = atomicAdd(finished, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    const long long* num_drafts = drafts_then_counts + (long long)num_seqs * max_drafts;
    for (int b = threadIdx.x; b < num_seqs; b += blockDim.x) {
        long long first = 0;
        for (int c = 0; c < b; ++c) first += num_drafts[c] + 1;
        const long long* drafts = drafts_then_counts + (long long)b * max_drafts;
        long long* mine = resolved + (long long)b * max_drafts;
        for (int k = 0; k < max_drafts; ++k) {
            const long long d = drafts[k];
            mine[k] = (use_slots && d < 0 && k < num_drafts[b]) ? (long long)slots[~d] : d;
        }
        long long j = policy == 1 ? num_drafts[b] : 0;  // other blocks wrote tokens: read them past the L1 cache
        while (policy == 0 && j < num_drafts[b] && __ldcg(tokens + first + j) == mine[j]) ++j;
        const long long emitted = __ldcg(tokens + first + j);
        out[b] = j;
        out[num_seqs + b] = emitted;
        if (use_slots) {
            slots[(long long)b * width] = (int)emitted;
            accepted[b] = (int)j;
        }
    }
}
