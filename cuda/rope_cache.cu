// Rotate-half RoPE on q and k fused with the paged KV-cache write; twin: rope_and_cache in
// cupyspec/model/fused.py. One thread per (token, head, pair i < D/2) of the q, k and v heads:
//   q, k: (x_i, x_{i+D/2}) -> (x_i c - x_{i+D/2} s, x_{i+D/2} c + x_i s) in fp32, rounded to fp16;
//   k (roped) and v go to their cache slot, q (roped) to q_out (RopeCache in decoder.cuh).

#include "decoder.cuh"

extern "C" __global__ void rope_cache(
    const half* __restrict__ qkv,        // [T, (Hq + 2 Hkv) D]
    const float* __restrict__ cos,       // [P, D/2] by position
    const float* __restrict__ sin,       // [P, D/2]
    const int* __restrict__ positions,   // [T]
    const int* __restrict__ slots,       // [T] block * block_size + offset
    half* __restrict__ q_out,            // [T, Hq, D]
    half* __restrict__ k_cache,          // [slots, Hkv, D] this layer's
    half* __restrict__ v_cache,          // [slots, Hkv, D]
    int num_tokens, int num_heads, int num_kv_heads, int head_dim)
{
    release_dependent_grid();
    wait_for_prior_grid();
    const RopeCache rope{cos, sin, positions, slots, q_out, k_cache, v_cache, num_heads, num_kv_heads, head_dim};
    const int half_dim = head_dim / 2, heads = num_heads + 2 * num_kv_heads;
    const long long index = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= (long long)num_tokens * heads * half_dim) return;
    const int i = index % half_dim;
    const int head = (index / half_dim) % heads;
    const long long t = index / ((long long)half_dim * heads);
    const half* x = qkv + (t * heads + head) * head_dim;
    rope.store(t, head, i, __half2float(x[i]), __half2float(x[i + half_dim]));
}
