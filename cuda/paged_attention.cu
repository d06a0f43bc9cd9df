// Paged append attention over a flat ragged batch.
//
// One warp per (query token, query head). The query at position p of request b attends to the
// cached positions 0..p of b, whose K/V sit in the blocks block_tables[b, :]. Any mix of prefill
// chunks, verify segments and decode tokens runs in one launch. Online softmax in fp32.
// NumPy twin: cupyspec/model/attention.py (paged_attention).

#include <cuda_fp16.h>

#define WARP 32
#define MAX_DIMS_PER_LANE 4  // head_dim <= 128

extern "C" __global__ void paged_attention_f16(
    const half* __restrict__ q,                  // [T, Hq, D]
    const half* __restrict__ k_cache,            // [num_blocks, block_size, Hkv, D]
    const half* __restrict__ v_cache,            // [num_blocks, block_size, Hkv, D]
    const int* __restrict__ block_tables,        // [B, max_blocks]
    const int* __restrict__ batch_id_per_token,  // [T]
    const int* __restrict__ positions,           // [T]
    half* __restrict__ out,                      // [T, Hq, D]
    int num_tokens, int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,
    float scale) {
  const int lane = threadIdx.x % WARP;
  const int head = blockIdx.y * (blockDim.x / WARP) + threadIdx.x / WARP;
  const int token = blockIdx.x;
  if (token >= num_tokens || head >= num_heads) return;
  const int kv_head = head / (num_heads / num_kv_heads);
  const int batch = batch_id_per_token[token];
  const int last = positions[token];
  const int dims = head_dim / WARP;  // dims per lane, 1..MAX_DIMS_PER_LANE

  float qv[MAX_DIMS_PER_LANE], acc[MAX_DIMS_PER_LANE];
  const half* qrow = q + ((size_t)token * num_heads + head) * head_dim;
#pragma unroll
  for (int i = 0; i < MAX_DIMS_PER_LANE; ++i) {
    qv[i] = i < dims ? __half2float(qrow[i * WARP + lane]) * scale : 0.f;
    acc[i] = 0.f;
  }
  float running_max = __int_as_float(0xff800000), running_sum = 0.f;  // -inf
  const int* table = block_tables + (size_t)batch * max_blocks;
  for (int pos = 0; pos <= last; ++pos) {
    const size_t slot = (size_t)table[pos / block_size] * block_size + pos % block_size;
    const size_t base = (slot * num_kv_heads + kv_head) * head_dim;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i)
      if (i < dims) dot += qv[i] * __half2float(k_cache[base + i * WARP + lane]);
#pragma unroll
    for (int offset = WARP / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffff, dot, offset);
    const float new_max = fmaxf(running_max, dot);
    const float correction = __expf(running_max - new_max);
    const float weight = __expf(dot - new_max);
    running_sum = running_sum * correction + weight;
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_LANE; ++i)
      if (i < dims) acc[i] = acc[i] * correction + weight * __half2float(v_cache[base + i * WARP + lane]);
    running_max = new_max;
  }
  half* orow = out + ((size_t)token * num_heads + head) * head_dim;
#pragma unroll
  for (int i = 0; i < MAX_DIMS_PER_LANE; ++i)
    if (i < dims) orow[i * WARP + lane] = __float2half(acc[i] / running_sum);
}
