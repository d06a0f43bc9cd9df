// Paged append attention over a flat ragged batch.
//
// Row t (a query token) of request b = batch_id_per_token[t] at position p = positions[t] attends to
// the cached positions 0..p of b, whose K/V sit in the blocks block_tables[b, :]. Any mix of prefill
// chunks, verify segments and decode tokens runs in one launch. Softmax in fp32.
// NumPy twin: cupyspec/model/attention.py (paged_attention).
//
// Work split. A CTA of WARPS warps serves one row and HEADS query heads of one KV head's GQA group,
// so that each K/V row is read once for all of them. The row's positions are cut into partitions
// (partition_size), a partition into tiles that go round-robin to the warps. In a warp, a group of
// LANES lanes reads one position's K/V row (16 bytes a lane, STEP positions at once) and keeps its own
// online softmax over the positions it reads. At the end of a partition the lane groups merge by
// shuffles, then the warps through shared memory, in a fixed order. Launches of few rows take CTAs of
// 8 warps, so that a warp waits for fewer tiles in turn; other launches CTAs of 4, which fold fewer
// warps' states per partition. The wrapper picks the warps on the number of rows only
// (cupyspec/model/attention.py).
//
// Partitions are folded left to right. With gridDim.z == 1 a CTA folds all its row's partitions
// itself. With gridDim.z == the most partitions a row can have (flash-decoding: few rows, long
// contexts) CTA z computes partition z only and writes its state to partial_*; the CTA that finishes
// last among a row's partitions (a counter in `arrivals`, which it resets to zero) folds the states.
// Both paths do the same arithmetic in the same order (the merges use no fused multiply-adds), so a
// row's output depends on that row and the CTA's warps alone: not on the other rows or on the path
// the wrapper picked. A split launch first prefetches its partition's K/V into L2, so that its warps
// wait for memory about once rather than once per tile.

#include <cuda_fp16.h>

#include "grid_dependency.cuh"

#define WARP 32
#define FULL_MASK 0xffffffffu
#define PARTITION 256  // positions per partition, but see partition_size
#define NEG_INF __int_as_float(0xff800000)
#define LOG2E 1.4426950408889634f

__device__ __forceinline__ float exp2_approx(float x) {  // 2^x, with 2^-inf = 0
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void prefetch_l2(const void* pointer) {
  asm volatile("prefetch.global.L2 [%0];" :: "l"(pointer));
}

__device__ __forceinline__ float half_at(uint4 raw, int i) {  // the i-th of 8 packed halves
  const unsigned int word = i < 2 ? raw.x : i < 4 ? raw.y : i < 6 ? raw.z : raw.w;
  return __half2float(__ushort_as_half((unsigned short)(i % 2 ? word >> 16 : word & 0xffffu)));
}

// Positions per partition of a row of `len` positions (partition_size in cupyspec/model/attention.py).
// CTAs of 4 warps (launches of many rows, whose CTAs fill the GPU) take PARTITION. CTAs of 8 warps
// cut a row of more than PARTITION and at most 4 * PARTITION positions into partitions of half as
// many, which spreads it over twice as many CTAs: a shorter row stays one partition, with nothing to
// fold, and a longer one has enough partitions already.
template <int WARPS>
__device__ __forceinline__ int partition_size(int len) {
  return WARPS == 8 && len > PARTITION && len <= 4 * PARTITION ? PARTITION / 2 : PARTITION;
}

// Merging two softmax states (max, sum, accumulator) with maxima m1 and m2: the new maximum and the
// factors that bring each side to it. With `combine`, symmetric in its sides and written without fused
// multiply-adds, a merge gives the same bits in whichever kernel or lane it runs.
struct Rescale {
  float max, first, second;
};

__device__ __forceinline__ Rescale rescale(float m1, float m2) {
  const float m = fmaxf(m1, m2);
  const float ref = m == NEG_INF ? 0.f : m;  // both sides empty: factors 0, not NaN
  return {m, exp2_approx(m1 - ref), exp2_approx(m2 - ref)};
}

__device__ __forceinline__ float combine(float x1, float c1, float x2, float c2) {
  return __fadd_rn(__fmul_rn(x1, c1), __fmul_rn(x2, c2));
}

// Folds the state (pm, ps, pa) of one output element into the state (m, s, a).
__device__ __forceinline__ void fold(float& m, float& s, float& a, float pm, float ps, float pa) {
  const Rescale r = rescale(m, pm);
  s = combine(s, r.first, ps, r.second);
  a = combine(a, r.first, pa, r.second);
  m = r.max;
}

// DP: head_dim (a multiple of 8) padded to 32, 64 or 128; HEADS: query heads of one GQA group per CTA;
// WARPS: of the CTA.
template <int DP, int HEADS, int WARPS>
__device__ __forceinline__ void attend(
    const half* __restrict__ q,                  // [T, Hq, D]
    const half* __restrict__ k_cache,            // [num_blocks, block_size, Hkv, D]
    const half* __restrict__ v_cache,            // [num_blocks, block_size, Hkv, D]
    const int* __restrict__ block_tables,        // [B, max_blocks]
    const int* __restrict__ batch_id_per_token,  // [T]
    const int* __restrict__ positions,           // [T]
    half* __restrict__ out,                      // [T, Hq, D]
    float* __restrict__ partial_acc,             // [T, Hq, gridDim.z, D] when gridDim.z > 1
    float2* __restrict__ partial_stats,          // [T, Hq, gridDim.z] (max, sum) when gridDim.z > 1
    int* __restrict__ arrivals,                  // [T, gridDim.y] zeros when gridDim.z > 1, left zero
    int num_heads, int num_kv_heads, int head_dim, int log2_block_size, int max_blocks, float scale) {
  constexpr int LANES = DP / 8;                // lanes per K/V row, 8 dims each
  constexpr int STEP = WARP / LANES;           // positions a warp reads at once
  constexpr int UNROLL = HEADS <= 4 ? 4 : 2;   // steps per tile: loads in flight against registers
  constexpr int TILE = UNROLL * STEP;          // positions of a tile
  constexpr int THREADS = WARPS * WARP;
  constexpr int ELEMS = (HEADS * DP + THREADS - 1) / THREADS;  // output elements per thread
  __shared__ int blocks_s[PARTITION];                          // the partition's KV blocks
  __shared__ float acc_s[WARPS][HEADS][DP];                    // the warps' partition states
  __shared__ float max_s[WARPS][HEADS], sum_s[WARPS][HEADS];
  __shared__ float run_s[3][HEADS * DP];  // the fold over partitions (max, sum, acc) per element
  __shared__ bool last_s;                  // split: this CTA is the row's last to finish

  release_dependent_grid();
  const int row = gridDim.x - 1 - blockIdx.x;  // the longest rows of a prefill chunk start first
  const int last = positions[row];
  const int partition = partition_size<WARPS>(last + 1);
  const int num_parts = last / partition + 1;
  const bool split = gridDim.z > 1;
  if (blockIdx.z >= num_parts) return;
  const int group = num_heads / num_kv_heads, chunks = gridDim.y / num_kv_heads;
  const int kv_head = blockIdx.y / chunks, first = (blockIdx.y % chunks) * HEADS;  // in the group
  const int* table = block_tables + (size_t)batch_id_per_token[row] * max_blocks;
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int slice = lane % LANES, sub = lane / LANES;  // dims 8*slice.., position sub of a step
  const bool dims_ok = slice * 8 < head_dim;
  const int p_begin = blockIdx.z, p_end = split ? p_begin + 1 : num_parts;
  auto kv_at = [&](int p, int offset, int dim) {  // element `dim` of the K/V row at `offset` in partition p
    const int pos = p * partition + offset, first_block = (p * partition) >> log2_block_size;
    const size_t slot = ((size_t)blocks_s[(pos >> log2_block_size) - first_block] << log2_block_size) +
                        (pos & ((1 << log2_block_size) - 1));
    return (slot * num_kv_heads + kv_head) * head_dim + dim;
  };
  auto partition_len = [&](int p) { return min(partition, last + 1 - p * partition); };  // positions of partition p
  auto stage = [&](int p) {  // partition p's KV blocks into blocks_s; split, its K/V rows into L2 at once
    const int start = p * partition, len = partition_len(p);
    const int first_block = start >> log2_block_size;
    for (int i = threadIdx.x; i <= ((start + len - 1) >> log2_block_size) - first_block; i += THREADS)
      blocks_s[i] = table[first_block + i];
    __syncthreads();
    if (split) {  // few rows: 32-byte sectors over the threads
      const int sectors = (head_dim + 15) / 16;
#pragma unroll 1
      for (int i = threadIdx.x; i < len * sectors; i += THREADS) {
        const size_t at = kv_at(p, i / sectors, i % sectors * 16);
        prefetch_l2(k_cache + at);
        prefetch_l2(v_cache + at);
      }
    }
  };
  stage(p_begin);  // before the wait: the block tables come before any kernel of the step, a prefetch only warms L2
  wait_for_prior_grid();  // q and the newest K/V rows come from the kernel before

  float qf[HEADS][8];  // q * scale * log2(e): scores in base 2
#pragma unroll
  for (int h = 0; h < HEADS; ++h) {
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (dims_ok && first + h < group)
      raw = *reinterpret_cast<const uint4*>(
          q + ((size_t)row * num_heads + kv_head * group + first + h) * head_dim + slice * 8);
#pragma unroll
    for (int i = 0; i < 8; ++i) qf[h][i] = half_at(raw, i) * (scale * LOG2E);
  }

  for (int p = p_begin; p < p_end; ++p) {
    if (p != p_begin) stage(p);
    const int len = partition_len(p);

    float m[HEADS], l[HEADS], acc[HEADS][8];  // this lane group's online softmax, base 2
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
      m[h] = NEG_INF;
      l[h] = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;
    }
    const int tiles = (len + TILE - 1) / TILE;
    for (int tile = warp; tile < tiles; tile += WARPS) {
      uint4 k_raw[UNROLL], v_raw[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int offset = tile * TILE + u * STEP + sub;  // in the partition
        k_raw[u] = v_raw[u] = make_uint4(0, 0, 0, 0);
        if (offset < len && dims_ok) {
          const size_t at = kv_at(p, offset, slice * 8);
          k_raw[u] = __ldg(reinterpret_cast<const uint4*>(k_cache + at));
          v_raw[u] = __ldg(reinterpret_cast<const uint4*>(v_cache + at));
        }
      }
      float s[UNROLL][HEADS];  // scores
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        float kf[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) kf[i] = half_at(k_raw[u], i);
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
          float dot = 0.f;
#pragma unroll
          for (int i = 0; i < 8; ++i) dot = fmaf(qf[h][i], kf[i], dot);
#pragma unroll
          for (int offset = LANES / 2; offset > 0; offset /= 2) dot += __shfl_xor_sync(FULL_MASK, dot, offset);
          s[u][h] = tile * TILE + u * STEP + sub < len ? dot : NEG_INF;
        }
      }
      float correction[HEADS];  // and s becomes the weights 2^(s - max)
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        float tile_max = s[0][h];
#pragma unroll
        for (int u = 1; u < UNROLL; ++u) tile_max = fmaxf(tile_max, s[u][h]);
        const float new_max = fmaxf(m[h], tile_max);
        const float ref = new_max == NEG_INF ? 0.f : new_max;
        correction[h] = exp2_approx(m[h] - ref);
        float w_sum = 0.f;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
          s[u][h] = exp2_approx(s[u][h] - ref);
          w_sum += s[u][h];
        }
        l[h] = fmaf(l[h], correction[h], w_sum);
        m[h] = new_max;
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        float vf[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) vf[u] = half_at(v_raw[u], i);
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
          float a = acc[h][i] * correction[h];
#pragma unroll
          for (int u = 0; u < UNROLL; ++u) a = fmaf(s[u][h], vf[u], a);
          acc[h][i] = a;
        }
      }
    }

    // the lane groups of a warp, then the warps in order: the partition's state per output element
#pragma unroll
    for (int offset = LANES; offset < WARP; offset *= 2) {
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
        const Rescale r = rescale(m[h], __shfl_xor_sync(FULL_MASK, m[h], offset));
        l[h] = combine(l[h], r.first, __shfl_xor_sync(FULL_MASK, l[h], offset), r.second);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          acc[h][i] = combine(acc[h][i], r.first, __shfl_xor_sync(FULL_MASK, acc[h][i], offset), r.second);
        m[h] = r.max;
      }
    }
    if (sub == 0) {
#pragma unroll
      for (int h = 0; h < HEADS; ++h) {
#pragma unroll
        for (int i = 0; i < 8; ++i) acc_s[warp][h][slice * 8 + i] = acc[h][i];
        if (lane == 0) max_s[warp][h] = m[h], sum_s[warp][h] = l[h];
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < ELEMS; ++k) {
      const int e = threadIdx.x + k * THREADS, h = e / DP, d = e % DP;
      if (e < HEADS * DP) {
        float pm = max_s[0][h], ps = sum_s[0][h], pa = acc_s[0][h][d];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) fold(pm, ps, pa, max_s[w][h], sum_s[w][h], acc_s[w][h][d]);
        if (p == p_begin) {
          run_s[0][e] = pm, run_s[1][e] = ps, run_s[2][e] = pa;
        } else {
          fold(run_s[0][e], run_s[1][e], run_s[2][e], pm, ps, pa);
        }
      }
    }
    __syncthreads();  // before blocks_s and the warps' states are reused
  }

  // The row's output; or, split over several partitions, this one's state, and the fold of all of
  // them by the CTA that finishes last.
  const bool partial = split && num_parts > 1;
#pragma unroll
  for (int k = 0; k < ELEMS; ++k) {
    const int e = threadIdx.x + k * THREADS, h = e / DP, d = e % DP;
    if (e < HEADS * DP && first + h < group && d < head_dim) {
      const size_t head = (size_t)row * num_heads + kv_head * group + first + h;
      if (partial) {
        partial_acc[(head * gridDim.z + p_begin) * head_dim + d] = run_s[2][e];
        if (d == 0) partial_stats[head * gridDim.z + p_begin] = make_float2(run_s[0][e], run_s[1][e]);
      } else {
        out[head * head_dim + d] = __float2half_rn(__fdiv_rn(run_s[2][e], run_s[1][e]));
      }
    }
  }
  if (!partial) return;
  __threadfence();  // this partition's state is visible to the CTA that folds ...
  __syncthreads();
  if (threadIdx.x == 0) {
    int* arrived = arrivals + (size_t)row * gridDim.y + blockIdx.y;
    last_s = atomicAdd(arrived, 1) == num_parts - 1;
    if (last_s) *arrived = 0;  // every partition has arrived: ready for the next launch
  }
  __syncthreads();
  if (!last_s) return;
  __threadfence();  // ... and read by it past L1 (__ldcg)
#pragma unroll
  for (int k = 0; k < ELEMS; ++k) {
    const int e = threadIdx.x + k * THREADS, h = e / DP, d = e % DP;
    if (e < HEADS * DP && first + h < group && d < head_dim) {
      const size_t head = (size_t)row * num_heads + kv_head * group + first + h;
      const float2* stats = partial_stats + head * gridDim.z;
      const float* acc = partial_acc + head * gridDim.z * head_dim + d;
      float2 st = __ldcg(stats);
      float m = st.x, sum = st.y, a = __ldcg(acc);
      for (int p = 1; p < num_parts; ++p) {
        st = __ldcg(stats + p);
        fold(m, sum, a, st.x, st.y, __ldcg(acc + (size_t)p * head_dim));
      }
      out[head * head_dim + d] = __float2half_rn(__fdiv_rn(a, sum));
    }
  }
}

// paged_attention_d{DP}_h{HEADS}_w{WARPS}: grid (T, Hkv * ceil(group / HEADS), 1 or the most
// partitions), WARPS * 32 threads. MIN_CTAS (4-warp CTAs resident per SM; of 8-warp CTAs half as
// many, rounded down) caps the registers where that costs no spills.
#define PAGED_ATTENTION_WARPS(DP, HEADS, MIN_CTAS, WARPS)                                                   \
  extern "C" __global__ void __launch_bounds__(WARPS * WARP, MIN_CTAS * 4 / WARPS)                          \
      paged_attention_d##DP##_h##HEADS##_w##WARPS(                                                        \
          const half* __restrict__ q, const half* __restrict__ k_cache, const half* __restrict__ v_cache, \
          const int* __restrict__ block_tables, const int* __restrict__ batch_id_per_token,               \
          const int* __restrict__ positions, half* __restrict__ out, float* __restrict__ partial_acc,      \
          float2* __restrict__ partial_stats, int* __restrict__ arrivals, int num_heads, int num_kv_heads, \
          int head_dim, int log2_block_size, int max_blocks, float scale) {                               \
    attend<DP, HEADS, WARPS>(q, k_cache, v_cache, block_tables, batch_id_per_token, positions, out,       \
                             partial_acc, partial_stats, arrivals, num_heads, num_kv_heads, head_dim,     \
                             log2_block_size, max_blocks, scale);                                         \
  }

#define PAGED_ATTENTION(DP, HEADS, MIN_CTAS)    \
  PAGED_ATTENTION_WARPS(DP, HEADS, MIN_CTAS, 4) \
  PAGED_ATTENTION_WARPS(DP, HEADS, MIN_CTAS, 8)

#define PAGED_ATTENTION_ALL_HEADS(DP, MIN_CTAS_6) \
  PAGED_ATTENTION(DP, 1, 4)                       \
  PAGED_ATTENTION(DP, 2, 4)                       \
  PAGED_ATTENTION(DP, 3, 4)                       \
  PAGED_ATTENTION(DP, 4, 3)                       \
  PAGED_ATTENTION(DP, 6, MIN_CTAS_6)              \
  PAGED_ATTENTION(DP, 8, 2)

PAGED_ATTENTION_ALL_HEADS(32, 2)
PAGED_ATTENTION_ALL_HEADS(64, 3)
PAGED_ATTENTION_ALL_HEADS(128, 3)
