// Fused accept-and-gather of logprobs under speculation; twin: cupyspec/spec/accept_gather.py.
//
// After verification, request b emits num_accepted[b] drafts and then one more token: the tokens
// at its logprob rows j = 0..num_accepted[b]. One block of threads
//   1. computes cu_batch_token_offset [B+1], the exclusive prefix sum of emitted tokens over the
//      requests that asked for logprobs (a chunked block scan), then
//   2. gathers, for each emitted token and each proposed draft of the requests that asked, its
//      logprob log_softmax(x)[t] = f32(f64(x[t] - peak) - log_total) and its row's top-k.
// The row normalizers and top-k come from a log-softmax that ran beside verification.

#define MAX_THREADS 1024

extern "C" __global__ void accept_gather_logprobs(
    const float* __restrict__ logits, long long vocab,          // [R, V] target rows
    const long long* __restrict__ row_target,                   // [L] target row of each logprob row
    const int* __restrict__ row_seq,                            // [L] its request b
    const int* __restrict__ row_pos,                            // [L] its position j among b's rows
    const float* __restrict__ peak,                             // [L] row maximum
    const double* __restrict__ log_total,                       // [L] log sum exp(x - peak)
    const long long* __restrict__ top_ids,                      // [L, k]
    const float* __restrict__ top_lps,                          // [L, k]
    int k,
    const long long* __restrict__ drafts, int max_drafts,       // [B, K]
    const long long* __restrict__ num_drafts,                   // [B]
    const long long* __restrict__ num_accepted,                 // [B] verification's verdict
    const long long* __restrict__ emitted,                      // [B] bonus or correction token
    const int* __restrict__ wants_tokens,                       // [B] 1: gather emitted tokens
    const long long* __restrict__ draft_offset,                 // [B+1] slots of each request's drafts
    int num_seqs, int num_rows,
    long long* __restrict__ cu_batch_token_offset,              // [B+1] out
    long long* __restrict__ token_ids,                          // [L] out, first cu[B] valid
    float* __restrict__ token_lps,                              // [L]
    long long* __restrict__ token_top_ids,                      // [L, k]
    float* __restrict__ token_top_lps,                          // [L, k]
    float* __restrict__ draft_lps,                              // [D]
    long long* __restrict__ draft_top_ids,                      // [D, k]
    float* __restrict__ draft_top_lps)                          // [D, k]
{
    __shared__ long long partial[MAX_THREADS];
    const int t = threadIdx.x, threads = blockDim.x;

    // ---- 1. cu_batch_token_offset ----
    const int chunk = (num_seqs + threads - 1) / threads;
    const int lo = min(t * chunk, num_seqs), hi = min(lo + chunk, num_seqs);
    long long sum = 0;
    for (int b = lo; b < hi; ++b) sum += wants_tokens[b] ? num_accepted[b] + 1 : 0;
    partial[t] = sum;
    __syncthreads();
    for (int stride = 1; stride < threads; stride <<= 1) {  // inclusive scan of the chunk sums
        const long long add = t >= stride ? partial[t - stride] : 0;
        __syncthreads();
        partial[t] += add;
        __syncthreads();
    }
    long long running = t > 0 ? partial[t - 1] : 0;
    for (int b = lo; b < hi; ++b) {
        cu_batch_token_offset[b] = running;
        running += wants_tokens[b] ? num_accepted[b] + 1 : 0;
    }
    if (t == threads - 1) cu_batch_token_offset[num_seqs] = partial[threads - 1];
    __syncthreads();

    // ---- 2. gather ----
    for (int r = t; r < num_rows; r += threads) {
        const int b = row_seq[r], j = row_pos[r];
        const float* x = logits + row_target[r] * vocab;
        const long long accepted = num_accepted[b];
        if (wants_tokens[b] && j <= accepted) {
            const long long token = j < accepted ? drafts[(long long)b * max_drafts + j] : emitted[b];
            const long long slot = cu_batch_token_offset[b] + j;
            token_ids[slot] = token;
            token_lps[slot] = (float)((double)(x[token] - peak[r]) - log_total[r]);
            for (int c = 0; c < k; ++c) {
                token_top_ids[slot * k + c] = top_ids[(long long)r * k + c];
                token_top_lps[slot * k + c] = top_lps[(long long)r * k + c];
            }
        }
        if (j < num_drafts[b] && draft_offset[b + 1] > draft_offset[b]) {
            const long long token = drafts[(long long)b * max_drafts + j];
            const long long slot = draft_offset[b] + j;
            draft_lps[slot] = (float)((double)(x[token] - peak[r]) - log_total[r]);
            for (int c = 0; c < k; ++c) {
                draft_top_ids[slot * k + c] = top_ids[(long long)r * k + c];
                draft_top_lps[slot * k + c] = top_lps[(long long)r * k + c];
            }
        }
    }
}
