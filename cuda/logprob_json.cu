// Logprobs as chat JSON entries (cuda/logprob_json.cuh), by a grid of blocks that share the
// writing; twin: cupyspec/logprobs/logprob_json.py.

#include "logprob_json.cuh"

#define THREADS 1024

extern "C" __global__ void render_chat_logprobs(
    const long long* __restrict__ token_ids,  // [N]
    const float* __restrict__ logprobs,       // [N]
    const long long* __restrict__ top_ids,    // [N, width]
    const float* __restrict__ top_lps,        // [N, width]
    int width,
    const long long* __restrict__ request_k,  // [B] alternatives per request; < 0: no entries
    const long long* __restrict__ cu,         // [B+1] rows of each request; null: row r is request r
    int num_requests, int num_rows,           // B, N
    const unsigned char* __restrict__ blob,   // vocabulary table (VocabJSON)
    const long long* __restrict__ text_at,    // [2V+1]
    unsigned char* __restrict__ out,          // [capacity]: the bytes past it are dropped
    long long capacity,
    long long* __restrict__ ends)             // [N]: where each row's entry ends (dropped bytes counted)
{
    render_rows(RenderArgs{token_ids, logprobs, top_ids, top_lps, width, request_k, cu, num_requests, num_rows,
                           blob, text_at, out, capacity, ends});
}
