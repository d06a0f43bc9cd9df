// Paged append attention over a flat ragged batch.
//
// Row t (a query token) of request b = batch_id_per_token[t] at position p = positions[t] attends to
// the cached positions 0..p of b, whose K/V sit in the blocks block_tables[b, :]. Any mix of prefill
// chunks, verify segments and decode tokens runs in one launch. Scores and softmax in fp32, the
// weights rounded to fp16 for the product with V.
// NumPy twin: cupyspec/model/attention.py (paged_attention).
//
// Work split. A CTA of WARPS warps serves one row and HEADS query heads of one KV head's GQA group,
// so that each K/V row is read once for all of them. The row's positions are cut into partitions
// (partition_size), a partition into tiles of 16 positions that go round-robin to the warps. A warp
// takes a tile on the tensor cores: the scores S = Q K^T of its heads (the rows of an m16 fragment)
// and then O^T += V^T P^T, with an online softmax per head. At the end of a partition the warps
// merge through shared memory, in a fixed order. Launches of few rows take CTAs of 8 warps, so that
// a warp waits for fewer tiles in turn; other launches CTAs of 4, which fold fewer warps' states per
// partition. The wrapper picks the warps on the number of rows only (cupyspec/model/attention.py).
//
// Grouped rows. In the grouped entry points (launches of many rows, mostly prefill chunks), a CTA may
// serve ROWS consecutive rows of one request instead, a (row, head) pair in each row of S's m16
// fragment, so that a prefill chunk reads each K/V row once for ROWS rows. The rows go in groups of
// ROWS from row 0: the CTA of a group's first row takes the whole group when one request holds it (the
// CTAs of its other rows leave at once), else its own row, like the CTA of any row outside a group.
// The fragment's rows are independent sums, and each pair keeps its own softmax state through the
// same tiles, warps and partitions as alone, so a row comes out with the same bits either way.
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
#include "mma.cuh"

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

// Halves [dim, dim + 2 * WORDS) of a row as WORDS words (2, or a multiple of 4), zero past head_dim
// (a multiple of 8) or where !ok.
template <int WORDS>
__device__ __forceinline__ void load_row(unsigned (&words)[WORDS], const half* row, int dim, int head_dim, bool ok) {
  if constexpr (WORDS == 2) {
    const uint2 raw = ok && dim < head_dim ? __ldg(reinterpret_cast<const uint2*>(row + dim)) : make_uint2(0, 0);
    words[0] = raw.x, words[1] = raw.y;
  } else {
#pragma unroll
    for (int i = 0; i < WORDS / 4; ++i) {
      const uint4 raw = ok && dim + 8 * i < head_dim ? __ldg(reinterpret_cast<const uint4*>(row + dim + 8 * i))
                                                     : make_uint4(0, 0, 0, 0);
      words[4 * i] = raw.x, words[4 * i + 1] = raw.y, words[4 * i + 2] = raw.z, words[4 * i + 3] = raw.w;
    }
  }
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
// ROWS: rows per CTA from `row` on (grouped when > 1: then 4 warps and no split); WARPS: of the CTA.
template <int DP, int HEADS, int ROWS, int WARPS>
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
    int row, int num_heads, int num_kv_heads, int head_dim, int log2_block_size, int max_blocks, float scale) {
  constexpr int TILE = 16;  // positions a warp takes at once: two n8 tiles of S, the k16 of P V
  constexpr int THREADS = WARPS * WARP;
  constexpr int PAIRS = ROWS * HEADS;                          // (row, head) pairs: S's rows 0..PAIRS-1
  constexpr bool HIGH_PAIRS = PAIRS > 8;                       // pairs in S's rows 8..15 too
  constexpr int ELEMS = (PAIRS * DP + THREADS - 1) / THREADS;  // output elements per thread
  static_assert(PAIRS <= 16 && (ROWS == 1 || (WARPS == 4 && PAIRS > HEADS)), "grouped: 4 warps, m16 rows");
  __shared__ int blocks_s[PARTITION];                          // the partition's KV blocks
  __shared__ float acc_s[WARPS][PAIRS][DP];                    // the warps' partition states
  __shared__ float max_s[WARPS][PAIRS], sum_s[WARPS][PAIRS];
  __shared__ float run_s[3][PAIRS * DP];  // the fold over partitions (max, sum, acc) per element
  __shared__ bool last_s;                  // split: this CTA is the row's last to finish

  int last = positions[row];  // the group's last position
#pragma unroll
  for (int r = 1; r < ROWS; ++r) last = max(last, positions[row + r]);
  const int partition = partition_size<WARPS>(last + 1);
  const int num_parts = last / partition + 1;
  const bool split = ROWS == 1 && gridDim.z > 1;
  if (blockIdx.z >= num_parts) return;
  const int group = num_heads / num_kv_heads, chunks = gridDim.y / num_kv_heads;
  const int kv_head = blockIdx.y / chunks, first = (blockIdx.y % chunks) * HEADS;  // in the group
  const int* table = block_tables + (size_t)batch_id_per_token[row] * max_blocks;
  const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
  const int g = lane / 4, c = lane % 4;  // fragment coordinates (cuda/mma.cuh)
  // S's row i holds pair i: row `row + pair_row(i)`, query head `first + pair_query(i)` of the group.
  auto pair_row = [](int i) { return ROWS == 1 ? 0 : i / HEADS; };
  auto pair_query = [](int i) { return ROWS == 1 ? i : i % HEADS; };
  auto pair_ok = [&](int i) { return i < PAIRS && first + pair_query(i) < group; };
  auto pair_head = [&](int i) {  // the pair's index in out [T, Hq]
    return (size_t)(row + pair_row(i)) * num_heads + kv_head * group + first + pair_query(i);
  };
  const float scale_log2 = scale * LOG2E;  // scores in base 2
  // The k order of S = Q K^T is free, as both sides take the same: k = 2c + e (e < 2) and 2c + 8 + e of
  // chunk kc stand for dim c * DP / 4 + 4kc + e and + 2 + e, so that a thread reads DP / 4 consecutive
  // dims. Likewise the m order of O^T = V^T P^T: rows g and g + 8 of m16 tile mt stand for dims
  // v_dim(mt, 0) and v_dim(mt, 1), so that a thread reads V's dims [g * DP / 8, (g + 1) * DP / 8).
  auto v_dim = [&](int mt, int i) { return g * (DP / 8) + 2 * mt + i; };
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

  // Q as the A fragment of S = Q K^T: rows g and g + 8 are pairs g and g + 8 (zero where there is no
  // such pair), their dims [c * DP / 4, (c + 1) * DP / 4) in the k order above. S's rows g and g + 8 are
  // this thread's halves h = 0 and 1, and so are the states below.
  unsigned q_words[2][DP / 8] = {};
  int last_of[2];  // the position of half h's row
#pragma unroll
  for (int h = 0; h < (HIGH_PAIRS ? 2 : 1); ++h) {
    const int i = g + 8 * h;
    load_row(q_words[h], q + (pair_ok(i) ? pair_head(i) : 0) * head_dim, c * (DP / 4), head_dim, pair_ok(i));
    last_of[h] = ROWS > 1 && pair_ok(i) ? positions[row + pair_row(i)] : last;
  }

  for (int p = p_begin; p < p_end; ++p) {
    if (p != p_begin) stage(p);
    const int len = partition_len(p);
    auto row_at = [&](const half* cache, int offset) {  // the K/V row at `offset` of the partition, if any
      return offset < len ? cache + kv_at(p, offset, 0) : cache;
    };

    constexpr int HALVES = HIGH_PAIRS ? 2 : 1;
    int len_of[HALVES];  // per half: the partition's positions its row sees
#pragma unroll
    for (int h = 0; h < HALVES; ++h) len_of[h] = min(partition, last_of[h] + 1 - p * partition);
    float m[HALVES], l[HALVES];  // per half: its pair's running maximum, this thread's share of its sum (base 2)
    float o[HALVES][DP / 16][4] = {};  // O^T: o[h][mt][2i + e] is pair 8h + 2c + e's dim v_dim(mt, i)
#pragma unroll
    for (int h = 0; h < HALVES; ++h) m[h] = NEG_INF, l[h] = 0.f;
    const int tiles = (len + TILE - 1) / TILE;
    for (int tile = warp; tile < tiles; tile += WARPS) {
      const int base = tile * TILE;
      // K^T's B fragments: positions base + 8j + g, dims as q_words. V's rows for V^T's A fragments:
      // positions base + 2c, 2c + 1, 2c + 8 and 2c + 9 (v_words[0..3]), dims [g * DP / 8, (g + 1) * DP / 8).
      unsigned k_words[2][DP / 8], v_words[4][DP / 16];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int offset = base + 8 * j + g;
        load_row(k_words[j], row_at(k_cache, offset), c * (DP / 4), head_dim, offset < len);
      }
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int offset = base + 2 * c + r % 2 + 8 * (r / 2);
        load_row(v_words[r], row_at(v_cache, offset), g * (DP / 8), head_dim, offset < len);
      }

      float s[2][4] = {};  // s[j][2h + e]: half h's score at position base + 8j + 2c + e (e < 2)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int kc = 0; kc < DP / 16; ++kc)
          mma_16816(s[j], q_words[0][2 * kc], q_words[1][2 * kc], q_words[0][2 * kc + 1], q_words[1][2 * kc + 1],
                    k_words[j][2 * kc], k_words[j][2 * kc + 1]);
      }
      // Per half: the tile's maximum, the correction of the state so far, and the weights 2^(s - max) in
      // fp16 as P^T's B fragment (p_words[h][j]: positions base + 8j + 2c..); the sum takes them as rounded.
      float correction[HALVES];
      unsigned p_words[HALVES][2];
#pragma unroll
      for (int h = 0; h < HALVES; ++h) {
        float tile_max = NEG_INF;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            s[j][2 * h + e] = base + 8 * j + 2 * c + e < len_of[h] ? s[j][2 * h + e] * scale_log2 : NEG_INF;
            tile_max = fmaxf(tile_max, s[j][2 * h + e]);
          }
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 1));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, 2));
        const float new_max = fmaxf(m[h], tile_max);
        const float ref = new_max == NEG_INF ? 0.f : new_max;
        correction[h] = exp2_approx(m[h] - ref);
        m[h] = new_max;
        float w_sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const __half2 w = __floats2half2_rn(exp2_approx(s[j][2 * h] - ref), exp2_approx(s[j][2 * h + 1] - ref));
          const float2 rounded = __half22float2(w);
          w_sum += rounded.x + rounded.y;
          p_words[h][j] = *reinterpret_cast<const unsigned*>(&w);
        }
        l[h] = fmaf(l[h], correction[h], w_sum);
      }
      // O^T += V^T P^T, an n8 tile per half. The threads' columns are pairs 8h + 2c and 8h + 2c + 1, whose
      // corrections the threads of S's rows 2c and 2c + 1 hold. V^T's A fragment pairs the same dim of two
      // positions' words.
#pragma unroll
      for (int h = 0; h < HALVES; ++h) {
        const float correction_0 = __shfl_sync(FULL_MASK, correction[h], 8 * c);
        const float correction_1 = __shfl_sync(FULL_MASK, correction[h], 8 * c + 4);
#pragma unroll
        for (int mt = 0; mt < DP / 16; ++mt) {
          constexpr unsigned LOW = 0x5410u, HIGH = 0x7632u;  // __byte_perm: the low or the high halves
          float (&acc)[4] = o[h][mt];
          acc[0] *= correction_0, acc[1] *= correction_1, acc[2] *= correction_0, acc[3] *= correction_1;
          const unsigned v0 = v_words[0][mt], v1 = v_words[1][mt], v2 = v_words[2][mt], v3 = v_words[3][mt];
          mma_16816(acc, __byte_perm(v0, v1, LOW), __byte_perm(v0, v1, HIGH), __byte_perm(v2, v3, LOW),
                    __byte_perm(v2, v3, HIGH), p_words[h][0], p_words[h][1]);
        }
      }
    }

    // the warp's state per pair (its four threads' sums added in a fixed order), then the warps in
    // order: the partition's state per output element
#pragma unroll
    for (int h = 0; h < HALVES; ++h) {
      l[h] += __shfl_xor_sync(FULL_MASK, l[h], 1);
      l[h] += __shfl_xor_sync(FULL_MASK, l[h], 2);
      if (g + 8 * h < PAIRS && c == 0) max_s[warp][g + 8 * h] = m[h], sum_s[warp][g + 8 * h] = l[h];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int i = 8 * h + 2 * c + e;
        if (i < PAIRS) {
#pragma unroll
          for (int mt = 0; mt < DP / 16; ++mt) {
            acc_s[warp][i][v_dim(mt, 0)] = o[h][mt][e];
            acc_s[warp][i][v_dim(mt, 1)] = o[h][mt][2 + e];
          }
        }
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < ELEMS; ++k) {
      const int e = threadIdx.x + k * THREADS, h = e / DP, d = e % DP;
      if (e < PAIRS * DP) {
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
    if (e < PAIRS * DP && pair_ok(h) && d < head_dim) {
      const size_t head = pair_head(h);
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
    if (e < PAIRS * DP && pair_ok(h) && d < head_dim) {
      const size_t head = pair_head(h);
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

// Rows per grouped CTA: as many as fill S's 16 fragment rows with pairs (8 at head_dim 128, where the
// states of 16 would not fit in static shared memory).
template <int DP, int HEADS>
__device__ constexpr int grouped_rows() {
  return (DP == 128 ? 8 : 16) / HEADS;
}

template <int DP, int HEADS, int WARPS, bool GROUPED>
__device__ __forceinline__ void attend_rows(
    const half* __restrict__ q, const half* __restrict__ k_cache, const half* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ batch_id_per_token,
    const int* __restrict__ positions, half* __restrict__ out, float* __restrict__ partial_acc,
    float2* __restrict__ partial_stats, int* __restrict__ arrivals, int num_tokens, int num_heads,
    int num_kv_heads, int head_dim, int log2_block_size, int max_blocks, float scale) {
  constexpr int ROWS = grouped_rows<DP, HEADS>();
  release_dependent_grid();
  const int row = gridDim.x - 1 - blockIdx.x;  // the longest rows of a prefill chunk start first
  if constexpr (GROUPED && ROWS > 1) {
    const int start = row - row % ROWS;  // of the row's group
    if (gridDim.z == 1 && start + ROWS <= num_tokens &&
        batch_id_per_token[start] == batch_id_per_token[start + ROWS - 1]) {  // a request's rows are contiguous
      if (row == start)
        attend<DP, HEADS, ROWS, 4>(q, k_cache, v_cache, block_tables, batch_id_per_token, positions, out,
                                   partial_acc, partial_stats, arrivals, start, num_heads, num_kv_heads, head_dim,
                                   log2_block_size, max_blocks, scale);
      return;
    }
  }
  attend<DP, HEADS, 1, WARPS>(q, k_cache, v_cache, block_tables, batch_id_per_token, positions, out, partial_acc,
                              partial_stats, arrivals, row, num_heads, num_kv_heads, head_dim, log2_block_size,
                              max_blocks, scale);
}

// paged_attention_d{DP}_h{HEADS}_w{WARPS}, and grouped paged_attention_d{DP}_h{HEADS}_g4 (4 warps, not
// split): grid (T, Hkv * ceil(group / HEADS), 1 or the most partitions), WARPS * 32 threads. MIN_CTAS
// (4-warp CTAs resident per SM; of 8-warp CTAs half as many, rounded down) caps the registers where
// that costs no spills.
#define PAGED_ATTENTION_ENTRY(NAME, DP, HEADS, WARPS, GROUPED, MIN_CTAS)                                    \
  extern "C" __global__ void __launch_bounds__(WARPS * WARP, MIN_CTAS * 4 / WARPS) NAME(                     \
      const half* __restrict__ q, const half* __restrict__ k_cache, const half* __restrict__ v_cache,       \
      const int* __restrict__ block_tables, const int* __restrict__ batch_id_per_token,                     \
      const int* __restrict__ positions, half* __restrict__ out, float* __restrict__ partial_acc,            \
      float2* __restrict__ partial_stats, int* __restrict__ arrivals, int num_tokens, int num_heads,         \
      int num_kv_heads, int head_dim, int log2_block_size, int max_blocks, float scale) {                   \
    attend_rows<DP, HEADS, WARPS, GROUPED>(q, k_cache, v_cache, block_tables, batch_id_per_token, positions, \
                                           out, partial_acc, partial_stats, arrivals, num_tokens, num_heads, \
                                           num_kv_heads, head_dim, log2_block_size, max_blocks, scale);     \
  }

#define PAGED_ATTENTION(DP, HEADS, MIN_CTAS)                                                  \
  PAGED_ATTENTION_ENTRY(paged_attention_d##DP##_h##HEADS##_w4, DP, HEADS, 4, false, MIN_CTAS) \
  PAGED_ATTENTION_ENTRY(paged_attention_d##DP##_h##HEADS##_w8, DP, HEADS, 8, false, MIN_CTAS) \
  PAGED_ATTENTION_ENTRY(paged_attention_d##DP##_h##HEADS##_g4, DP, HEADS, 4, true, MIN_CTAS)

#define PAGED_ATTENTION_ALL_HEADS(DP, MIN_CTAS) \
  PAGED_ATTENTION(DP, 1, MIN_CTAS)              \
  PAGED_ATTENTION(DP, 2, MIN_CTAS)              \
  PAGED_ATTENTION(DP, 3, MIN_CTAS)              \
  PAGED_ATTENTION(DP, 4, MIN_CTAS)              \
  PAGED_ATTENTION(DP, 6, MIN_CTAS)              \
  PAGED_ATTENTION(DP, 8, MIN_CTAS)

PAGED_ATTENTION_ALL_HEADS(32, 4)
PAGED_ATTENTION_ALL_HEADS(64, 4)
PAGED_ATTENTION_ALL_HEADS(128, 2)
