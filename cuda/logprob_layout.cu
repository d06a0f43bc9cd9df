// A verifying step's logprob layout expanded from its requests' fields, on the device; twin:
// LogprobLayout.build and .packed in cupyspec/logprobs/layout.py.
//
// The host has written each request's wants, drafts, num_drafts and first_row (the logits row of its
// first draft) into the packed layout of a CUDA graph's shape (B requests and L rows, at least the
// step's). One block of threads
//   1. computes two exclusive prefix sums over the requests: the first layout row of each that asked
//      for something (num_drafts + 1 rows each), and its first draft slot (draft_offset [B+1], over
//      the requests that asked for draft logprobs), then
//   2. writes each asking request's rows j = 0..num_drafts[b]: row_target = first_row[b] + j,
//      row_seq = b, row_pos = j; rows past theirs get row_target PAD_ROW, which reads no logits, and
//      row_pos PAD_POSITION, which scores nothing.

#include "block_scan.cuh"

#define MAX_THREADS 1024
#define PAD_ROW (-1LL)  // logprob_layout.py's
#define PAD_POSITION (1LL << 62)

extern "C" __global__ void expand_logprob_layout(long long* __restrict__ layout, int num_seqs, int num_rows,
                                                 int max_drafts)
{
    // ---- the packed layout (logprob_layout.py): rows, then the requests' fields ----
    long long* row_target = layout;
    long long* row_seq = row_target + num_rows;
    long long* row_pos = row_seq + num_rows;
    const long long* wants_tokens = row_pos + num_rows;
    long long* draft_offset = row_pos + num_rows + num_seqs;                              // [B+1]
    const long long* num_drafts = draft_offset + num_seqs + 1 + (long long)num_seqs * max_drafts;
    const long long* wants_drafts = num_drafts + 2 * num_seqs;                            // past render_k
    const long long* first_row = wants_drafts + num_seqs;

    __shared__ long long partial[MAX_THREADS];
    const int t = threadIdx.x, threads = blockDim.x;

    // ---- 1. the prefix sums, each thread over a chunk of requests ----
    const int chunk = (num_seqs + threads - 1) / threads;
    const int lo = min(t * chunk, num_seqs), hi = min(lo + chunk, num_seqs);
    long long rows = 0, slots = 0;
    for (int b = lo; b < hi; ++b) {
        rows += (wants_tokens[b] || wants_drafts[b]) ? num_drafts[b] + 1 : 0;
        slots += wants_drafts[b] ? num_drafts[b] : 0;
    }
    long long row = block_inclusive_scan(partial, rows) - rows;
    const long long used_rows = partial[threads - 1];
    __syncthreads();
    long long slot = block_inclusive_scan(partial, slots) - slots;
    if (t == threads - 1) draft_offset[num_seqs] = partial[threads - 1];

    // ---- 2. each request's rows and draft offset ----
    for (int b = lo; b < hi; ++b) {
        const long long n = num_drafts[b];
        draft_offset[b] = slot;
        slot += wants_drafts[b] ? n : 0;
        if (wants_tokens[b] || wants_drafts[b]) {
            for (long long j = 0; j <= n; ++j) {
                row_target[row + j] = first_row[b] + j;
                row_seq[row + j] = b;
                row_pos[row + j] = j;
            }
            row += n + 1;
        }
    }
    for (long long r = used_rows + t; r < num_rows; r += threads) {  // padding rows
        row_target[r] = PAD_ROW;
        row_seq[r] = 0;
        row_pos[r] = PAD_POSITION;
    }
}
