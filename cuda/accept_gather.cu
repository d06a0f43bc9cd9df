// Fused accept-and-gather of logprobs under speculation; twin: cupyspec/logprobs/accept_gather.py.
//
// After verification, request b emits num_accepted[b] drafts and then one more token: the tokens
// at its logprob rows j = 0..num_accepted[b]. One block of threads
//   1. computes cu_batch_token_offset [B+1], the exclusive prefix sum of emitted tokens over the
//      requests that asked for logprobs (a chunked block scan), then
//   2. gathers, for each emitted token and each proposed draft of the requests that asked, its
//      logprob log_softmax(x)[t] = f32(f64(x[t] - peak) - log_total) and its row's top-k;
//      token slots past cu_batch_token_offset[B] get token id -1 and zeros, draft slots past
//      draft_offset[B] zeros.
// The row normalizers and top-k come from a log-softmax that ran beside verification. The verdict
// is copied to runs_out, so that every output travels to the host in one copy.

#include "block_scan.cuh"

#define MAX_THREADS 1024

extern "C" __global__ void accept_gather_logprobs(
    const float* __restrict__ logits, long long vocab,          // [R, V] target rows
    const long long* __restrict__ layout,                       // UploadedLayout.packed (logprob_layout.py):
    int num_seqs, int num_rows, int max_drafts, int num_slots,  //   B, L, K; D draft slots
    const float* __restrict__ peak,                             // [L] row maximum
    const double* __restrict__ log_total,                       // [L] log sum exp(x - peak)
    const long long* __restrict__ top_ids,                      // [L, k]
    const float* __restrict__ top_lps,                          // [L, k]
    int k,
    const long long* __restrict__ runs,                         // [2, B] verdict: num_accepted, emitted token;
                                                                //   null: [2, B'] at the address the layout ends with
    long long* __restrict__ out)                                // GatheredLogprobs' buffer (accept_gather.py)
{
    // ---- inputs: row_target [L], row_seq [L], row_pos [L], wants_tokens [B], draft_offset [B+1],
    // drafts [B, K], num_drafts [B] (then render_k [B], for cuda/logprob_json.cu, wants_drafts [B] and
    // first_row [B], for cuda/logprob_layout.cu, the verdict's address and its B' <= B). A CUDA graph's
    // layout is padded: its rows past the step's have row_target PAD_ROW (-1) and a row_pos past every
    // draft, its requests past B' ask nothing and have no verdict.
    const long long* row_target = layout;
    const long long* row_seq = row_target + num_rows;
    const long long* row_pos = row_seq + num_rows;
    const long long* wants_tokens = row_pos + num_rows;
    const long long* draft_offset = wants_tokens + num_seqs;
    const long long* drafts = draft_offset + num_seqs + 1;
    const long long* num_drafts = drafts + (long long)num_seqs * max_drafts;
    const long long* tail = num_drafts + 4 * num_seqs;
    const long long* verdict = runs != nullptr ? runs : (const long long*)tail[0];
    const long long live = runs != nullptr ? num_seqs : tail[1];  // B'
    auto num_accepted = [&](long long b) { return b < live ? verdict[b] : 0LL; };
    auto emitted = [&](long long b) { return b < live ? verdict[live + b] : -1LL; };
    // ---- outputs: runs_out [2, B], cu_batch_token_offset [B+1], token_ids [L] (first cu[B] valid),
    // token_top_ids [L, k], draft_top_ids [D, k]; then float32: token_lps [L], token_top_lps [L, k],
    // draft_lps [D], draft_top_lps [D, k]
    long long* runs_out = out;
    long long* cu_batch_token_offset = runs_out + 2 * num_seqs;
    long long* token_ids = cu_batch_token_offset + num_seqs + 1;
    long long* token_top_ids = token_ids + num_rows;
    long long* draft_top_ids = token_top_ids + (long long)num_rows * k;
    float* token_lps = (float*)(draft_top_ids + (long long)num_slots * k);
    float* token_top_lps = token_lps + num_rows;
    float* draft_lps = token_top_lps + (long long)num_rows * k;
    float* draft_top_lps = draft_lps + num_slots;

    __shared__ long long partial[MAX_THREADS];
    const int t = threadIdx.x, threads = blockDim.x;

    // ---- 1. cu_batch_token_offset ----
    const int chunk = (num_seqs + threads - 1) / threads;
    const int lo = min(t * chunk, num_seqs), hi = min(lo + chunk, num_seqs);
    long long sum = 0;
    for (int b = lo; b < hi; ++b) sum += wants_tokens[b] ? num_accepted(b) + 1 : 0;
    block_inclusive_scan(partial, sum);  // of the chunk sums
    long long running = t > 0 ? partial[t - 1] : 0;
    for (int b = lo; b < hi; ++b) {
        cu_batch_token_offset[b] = running;
        running += wants_tokens[b] ? num_accepted(b) + 1 : 0;
        runs_out[b] = num_accepted(b);
        runs_out[num_seqs + b] = emitted(b);
    }
    const long long total = partial[threads - 1];
    if (t == threads - 1) cu_batch_token_offset[num_seqs] = total;
    for (long long slot = total + t; slot < num_rows; slot += threads) {  // unused token slots
        token_ids[slot] = -1;
        token_lps[slot] = 0.0f;
        for (int c = 0; c < k; ++c) {
            token_top_ids[slot * k + c] = 0;
            token_top_lps[slot * k + c] = 0.0f;
        }
    }
    for (long long slot = draft_offset[num_seqs] + t; slot < num_slots; slot += threads) {  // unused draft slots
        draft_lps[slot] = 0.0f;
        for (int c = 0; c < k; ++c) {
            draft_top_ids[slot * k + c] = 0;
            draft_top_lps[slot * k + c] = 0.0f;
        }
    }
    __syncthreads();

    // ---- 2. gather ----
    for (int r = t; r < num_rows; r += threads) {
        if (row_target[r] < 0) continue;  // a padding row: no logits, nothing to score
        const long long b = row_seq[r], j = row_pos[r];
        const float* x = logits + row_target[r] * vocab;
        const long long accepted = num_accepted(b);
        if (wants_tokens[b] && j <= accepted) {
            const long long token = j < accepted ? drafts[b * max_drafts + j] : emitted(b);
            const long long slot = cu_batch_token_offset[b] + j;
            token_ids[slot] = token;
            token_lps[slot] = (float)((double)(x[token] - peak[r]) - log_total[r]);
            for (int c = 0; c < k; ++c) {
                token_top_ids[slot * k + c] = top_ids[(long long)r * k + c];
                token_top_lps[slot * k + c] = top_lps[(long long)r * k + c];
            }
        }
        if (j < num_drafts[b] && draft_offset[b + 1] > draft_offset[b]) {
            const long long token = drafts[b * max_drafts + j];
            const long long slot = draft_offset[b] + j;
            draft_lps[slot] = (float)((double)(x[token] - peak[r]) - log_total[r]);
            for (int c = 0; c < k; ++c) {
                draft_top_ids[slot * k + c] = top_ids[(long long)r * k + c];
                draft_top_lps[slot * k + c] = top_lps[(long long)r * k + c];
            }
        }
    }
}
