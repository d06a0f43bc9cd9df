// The gemv kernels: matrix products of up to 8 rows (decode and verify steps), streaming each weight
// once; twins: linear and add_linear in cupyspec/model/linear.py, and the fused steps of
// cupyspec/model/fused.py. gemm.cu instantiates them over fp16 weights, gemv_packed.cu over packed
// ones (packed_weights.cuh); the epilogues serve gemm.cu's tiles too.
//
// out[m, n] = sum_k x[m, k] * w[n, k]: x [M, K] fp16 and w [N, K] (Hugging Face [out, in] layout),
// row-major, contiguous, 16-byte aligned, K % 8 == 0 (K % 32 == 0 packed); 1 <= M <= 8, any N >= 1.
// One block per 16 weight rows streams them once from memory. Each warp takes every 12th 32-wide slice
// of K; a slice is two mma.m16n8k16 with the 16 weight rows as A and the <= 8 rows of x as B (their
// columns), whose k order is permuted alike in A and B (each lane loads 8 consecutive k). The 12
// warps' sums are added in warp order through shared memory, so out[m, n] depends on x[m, :] and
// w[n, :] alone, never on M. The prologue can compute x = RMSNorm(residual), the epilogue SwiGLU or
// RoPE with the KV-cache write (decoder.cuh: the arithmetic of the separate kernels, so fused and
// separate steps give the same bits).

#pragma once

#include "decoder.cuh"
#include "mma.cuh"
#include "packed_weights.cuh"

// 16 bytes read by every block (activations): through the read-only cache.
__device__ __forceinline__ uint4 load_cached(const half* pointer) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(pointer));
    return v;
}

__device__ __forceinline__ float round_half(float v) { return __half2float(__float2half_rn(v)); }

// ---------------------------------------------------------------- epilogues

// Element-wise epilogues: one(m, n, v) for output (m, n), two(m, n, v0, v1) for (m, n) and (m, n + 1)
// (n even, N even: an aligned pair).
template <typename Out>
struct Store {  // out[m, n] = v, as fp16 (rounded to nearest) or fp32
    Out* out;  // [M, N]
    int N;
    __device__ __forceinline__ void one(int m, int n, float v) const {
        if constexpr (sizeof(Out) == 2) {
            out[(size_t)m * N + n] = __float2half_rn(v);
        } else {
            out[(size_t)m * N + n] = v;
        }
    }
    __device__ __forceinline__ void two(int m, int n, float v0, float v1) const {
        if constexpr (sizeof(Out) == 2) {
            *reinterpret_cast<half2*>(out + (size_t)m * N + n) = __floats2half2_rn(v0, v1);
        } else {
            *reinterpret_cast<float2*>(out + (size_t)m * N + n) = float2{v0, v1};
        }
    }
};

struct AddToResidual {  // residual[m, n] += fp16(v), in fp32
    float* residual;  // [M, N]
    int N;
    __device__ __forceinline__ void one(int m, int n, float v) const {
        float* r = residual + (size_t)m * N + n;
        *r = __fadd_rn(*r, round_half(v));
    }
    __device__ __forceinline__ void two(int m, int n, float v0, float v1) const {
        float2* r = reinterpret_cast<float2*>(residual + (size_t)m * N + n);
        const float2 old = *r;
        *r = float2{__fadd_rn(old.x, round_half(v0)), __fadd_rn(old.y, round_half(v1))};
    }
};

// A tile's outputs (m, n) and (m, n + 1): as an aligned pair when N is even and both are in range.
template <typename E>
__device__ __forceinline__ void adjacent(const E& e, int m, int n, float v0, float v1) {
    if ((e.N & 1) == 0 && n + 1 < e.N) {
        e.two(m, n, v0, v1);
    } else {
        if (n < e.N) e.one(m, n, v0);
        if (n + 1 < e.N) e.one(m, n + 1, v1);
    }
}

// gemv epilogues take a block's outputs in pairs: (m, n_lo) and (m, n_hi) of one x row (see gemv).
template <typename E>
struct Each {  // an element-wise epilogue on the outputs in range
    E e;
    __device__ __forceinline__ void operator()(int m, int n_lo, int n_hi, float lo, float hi) const {
        if (n_lo < e.N) e.one(m, n_lo, lo);
        if (n_hi < e.N) e.one(m, n_hi, hi);
    }
};

struct SwiGLU {  // rows (j, F + j) of gate_up [2F, K]: out[m, j] = fp16(silu(gate) * up) of the fp16 products
    half* out;  // [M, F]
    int width;  // F
    __device__ __forceinline__ void operator()(int m, int n_lo, int, float lo, float hi) const {
        out[(size_t)m * width + n_lo] = __float2half_rn(silu_mul(round_half(lo), round_half(hi)));
    }
};

struct Rope {  // rows (i, i + D/2) of a qkv head: fp16 products, plus the fp32 bias rounded again, roped
    RopeCache rope;
    const float* bias;  // [N] or nullptr
    __device__ __forceinline__ float value(int n, float v) const {
        return bias ? round_half(__fadd_rn(round_half(v), bias[n])) : round_half(v);
    }
    __device__ __forceinline__ void operator()(int m, int n_lo, int n_hi, float lo, float hi) const {
        rope.store(m, n_lo / rope.head_dim, n_lo % rope.head_dim, value(n_lo, lo), value(n_hi, hi));
    }
};

// ---------------------------------------------------------------- gemv: M <= 8

#define GEMV_ROWS 16      // weight rows (outputs n) per block: the m16 of the mma
#define GEMV_MAX_ROWS 8   // rows of x: the n8 of the mma
// GEMV_WARPS (warps per block) and GEMV_UNROLL (slices a warp has in flight) are packed_weights.cuh's:
// packed rows follow the gemv's rounds.

static_assert(GEMV_WARPS >= GEMV_MAX_ROWS, "a warp per x row for the RMSNorm prologue");

// x sources: prepare(M) once per block (all threads), then load(m, k): x[m, k..k+7] as 8 packed halves.
struct HalfRows {  // x [M, K] fp16
    const half* x;
    int K;
    __device__ __forceinline__ void prepare(int) const {}
    __device__ __forceinline__ uint4 load(int m, int k) const { return load_cached(x + (size_t)m * K + k); }
};

struct NormedRows {  // x = RMSNorm(residual) rows, fp16, as the rms_norm kernel computes them
    const float* residual;  // [M, K] fp32
    const float* weight;    // [K] fp32
    float eps;
    int K;
    float* inv_rms;         // shared [GEMV_MAX_ROWS]
    __device__ __forceinline__ void prepare(int M) const {  // warp m: row m's inverse RMS
        const int warp = threadIdx.x >> 5;
        if (warp < M) {
            const float r = warp_inv_rms(residual + (size_t)warp * K, K, eps);
            if ((threadIdx.x & 31) == 0) inv_rms[warp] = r;
        }
        __syncthreads();
    }
    __device__ __forceinline__ uint4 load(int m, int k) const {
        const float4* r = reinterpret_cast<const float4*>(residual + (size_t)m * K + k);
        const float4* g = reinterpret_cast<const float4*>(weight + k);
        const float4 r0 = __ldg(r), r1 = __ldg(r + 1), g0 = __ldg(g), g1 = __ldg(g + 1);
        const float s = inv_rms[m];
        return uint4{pack(normed(r0.x, s, g0.x), normed(r0.y, s, g0.y)),
                     pack(normed(r0.z, s, g0.z), normed(r0.w, s, g0.w)),
                     pack(normed(r1.x, s, g1.x), normed(r1.y, s, g1.y)),
                     pack(normed(r1.z, s, g1.z), normed(r1.w, s, g1.w))};
    }
};

// Block b's 16 weight rows (the mma's m16): row g < 8 is weight row pair_row(b, g, span), row g + 8 is
// that one + span / 2. span 16: 16 consecutive rows; span D (RoPE: dims i, i + D/2 of a head) or 2F
// (SwiGLU: gate row j, up row F + j): a block holds both rows of each of its 8 output pairs.
__device__ __forceinline__ int pair_row(int block, int g, int span) {
    const int blocks_per_span = span / GEMV_ROWS;
    return block / blocks_per_span * span + block % blocks_per_span * 8 + g;
}

// Grid: ceil(N / 16) blocks of GEMV_WARPS * 32 threads; span 16, or a multiple of 16 dividing N.
template <typename Source, typename Weights, typename Epilogue>
__device__ __forceinline__ void gemv(const Source& source, const Weights& weights, int M, int N, int K, int span,
                                     const Epilogue& epilogue)
{
    __shared__ float partial[GEMV_WARPS][4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = lane >> 2, quad = lane & 3;   // mma fragment row group and thread in group
    const int lo_row = pair_row(blockIdx.x, group, span), hi_row = lo_row + span / 2;
    const bool lo_ok = lo_row < N, hi_ok = hi_row < N, x_ok = group < M;
    // This lane's 8 consecutive k of each slice: A rows group and group + 8 (weight rows lo_row and
    // hi_row), B column group (x row group); rows out of range are never read (zero values).
    const int slices = (K + 31) >> 5;

    typename Weights::Raw lo, hi;  // slices first + GEMV_WARPS u (u < GEMV_UNROLL) of rows lo_row and hi_row
    auto load_weights = [&](int first) {
        lo = lo_ok ? weights.fetch(lo_row, first, quad) : typename Weights::Raw{};
        hi = hi_ok ? weights.fetch(hi_row, first, quad) : typename Weights::Raw{};
    };
    release_dependent_grid();
    load_weights(warp);   // the first round of weights is in flight during the prologue, and with
    wait_for_prior_grid();  // programmatic dependent launch while the kernel before still runs
    source.prepare(M);

    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int first = warp; first < slices; first += GEMV_WARPS * GEMV_UNROLL) {
        if (first != warp) load_weights(first);
        uint4 xv[GEMV_UNROLL];
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int k = (first + u * GEMV_WARPS) * 32 + 8 * quad;
            xv[u] = k < K && x_ok ? source.load(group, k) : uint4{};
        }
        // A fragment {a0a1, a2a3, a4a5, a6a7} = rows (g, g+8, g, g+8) at logical k (2q, 2q, 2q+8, 2q+8),
        // B fragment {b0b1, b2b3} = column g at logical k (2q, 2q+8): logical 2q, 2q+8 of the first
        // mma are this lane's k 0-1, 2-3; of the second mma its k 4-5, 6-7 (the same for A and B).
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const uint4 a_lo = weights.expand(lo, u), a_hi = weights.expand(hi, u);
            mma_16816(acc, a_lo.x, a_hi.x, a_lo.y, a_hi.y, xv[u].x, xv[u].y);
            mma_16816(acc, a_lo.z, a_hi.z, a_lo.w, a_hi.w, xv[u].z, xv[u].w);
        }
    }

    // acc = D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1]: D[i][j] = out[m = j, n = row i of the block].
    // Thread c * 32 + l sums x row m = 2 (l % 4) + c over the warps, for block rows l / 4 and l / 4 + 8.
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][i][lane] = acc[i];
    __syncthreads();
    if (threadIdx.x < 2 * 32) {
        const int c = threadIdx.x >> 5, l = threadIdx.x & 31;
        float lo_sum = partial[0][c][l], hi_sum = partial[0][2 + c][l];
#pragma unroll
        for (int v = 1; v < GEMV_WARPS; ++v) {
            lo_sum += partial[v][c][l];
            hi_sum += partial[v][2 + c][l];
        }
        const int m = 2 * (l & 3) + c, n_lo = pair_row(blockIdx.x, l >> 2, span);
        if (m < M) epilogue(m, n_lo, n_lo + span / 2, lo_sum, hi_sum);
    }
}

// The gemv entry points over weights of one format, each name followed by SUFFIX: w and scales as
// WEIGHTS (packed_weights.cuh) takes them, with __launch_bounds__ BOUNDS. Grids: ceil(N / 16) blocks of
// 384 threads; x, residual [M, K] with M <= 8.
//   gemv_f16, gemv_add:  out [M, N] fp16 = x @ w.T;  residual [M, N] fp32 += fp16(x @ w.T)
//   gemv_norm_swiglu:    out = swiglu(RMSNorm(residual) @ w.T): w [2F, K] gate rows first, F % 8 == 0;
//                        out [M, F]
//   gemv_norm_rope:      RoPE and the KV-cache write of qkv = RMSNorm(residual) @ w.T (+ bias):
//                        w [(Hq + 2 Hkv) D, K], D % 16 == 0; q_out [M, Hq, D]; cos, sin [P, D/2];
//                        positions, slots [M]
#define GEMV_KERNEL(BOUNDS) extern "C" __global__ void BOUNDS
#define GEMV_ENTRY_POINTS(SUFFIX, WEIGHTS, BOUNDS)                                                              \
    GEMV_KERNEL(BOUNDS) gemv_f16##SUFFIX(const half* __restrict__ x, const void* __restrict__ w,                \
                                 const void* __restrict__ scales, half* __restrict__ out, int M, int N, int K)  \
    {                                                                                                         \
        gemv(HalfRows{x, K}, WEIGHTS(w, scales, K), M, N, K, GEMV_ROWS, Each<Store<half>>{{out, N}});        \
    }                                                                                                         \
    GEMV_KERNEL(BOUNDS) gemv_add##SUFFIX(const half* __restrict__ x, const void* __restrict__ w,                \
                                 const void* __restrict__ scales, float* __restrict__ residual, int M, int N,   \
                                 int K)                                                                        \
    {                                                                                                         \
        gemv(HalfRows{x, K}, WEIGHTS(w, scales, K), M, N, K, GEMV_ROWS, Each<AddToResidual>{{residual, N}}); \
    }                                                                                                         \
    GEMV_KERNEL(BOUNDS) gemv_norm_swiglu##SUFFIX(const float* __restrict__ residual, const float* __restrict__ norm_weight, \
                                         float eps, const void* __restrict__ w, const void* __restrict__ scales, \
                                         half* __restrict__ out, int M, int N, int K)                          \
    {                                                                                                         \
        __shared__ float inv_rms[GEMV_MAX_ROWS];                                                              \
        gemv(NormedRows{residual, norm_weight, eps, K, inv_rms}, WEIGHTS(w, scales, K), M, N, K, N,           \
             SwiGLU{out, N / 2});                                                                             \
    }                                                                                                         \
    GEMV_KERNEL(BOUNDS) gemv_norm_rope##SUFFIX(const float* __restrict__ residual, const float* __restrict__ norm_weight, \
                                       float eps, const void* __restrict__ w, const void* __restrict__ scales,  \
                                       const float* __restrict__ bias, int has_bias, const float* __restrict__ cos, \
                                       const float* __restrict__ sin, const int* __restrict__ positions,       \
                                       const int* __restrict__ slots, half* __restrict__ q_out,                \
                                       half* __restrict__ k_cache, half* __restrict__ v_cache, int M, int N,    \
                                       int K, int num_kv_heads, int head_dim)                                  \
    {                                                                                                         \
        __shared__ float inv_rms[GEMV_MAX_ROWS];                                                              \
        const RopeCache rope{cos, sin, positions, slots, q_out, k_cache, v_cache,                             \
                             N / head_dim - 2 * num_kv_heads, num_kv_heads, head_dim};                        \
        gemv(NormedRows{residual, norm_weight, eps, K, inv_rms}, WEIGHTS(w, scales, K), M, N, K, head_dim,    \
             Rope{rope, has_bias ? bias : nullptr});                                                          \
    }
