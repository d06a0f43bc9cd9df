// Matrix products out = x @ w.T on tensor cores; twin: linear in cupyspec/model/linear.py.
//
// out[m, n] = sum_k x[m, k] * w[n, k]: x [M, K] and w [N, K] (Hugging Face [out, in] layout) fp16,
// row-major, contiguous, 16-byte aligned, K % 8 == 0; any M, N >= 1. Products are summed in fp32;
// the epilogue stores them as fp16 (round to nearest, entry points *_f16) or as fp32 (*_f32), or adds
// them, rounded to fp16, to an fp32 residual stream (*_add). The gemv kernels also fuse the decoder
// steps around a product (twins in cupyspec/model/fused.py): x = RMSNorm(residual) computed in the
// prologue, SwiGLU or RoPE with the KV-cache write in the epilogue (decoder.cuh: the same arithmetic
// as the separate kernels, so fused and separate steps give the same bits).
//
// No split-K and no dependence on the batch: out[m, n] is a function of x[m, :] and w[n, :] alone,
// whatever M is, so that rows padded into a larger batch (CUDA graphs of fixed sizes) come out
// bit-identical. Within a family the order of the fp32 sums is fixed by K alone:
//
//   gemv_*     (M <= 8, decode): one block per 16 weight rows, streaming them once from memory with
//              16-byte loads. Each warp takes every 12th 32-wide slice of K; a slice is two
//              mma.m16n8k16 with the 16 weight rows as A and the <= 8 rows of x as B (their columns),
//              whose k order is permuted alike in A and B (each lane loads 8 consecutive k). The
//              12 warps' sums are added in warp order through shared memory.
//   gemm_tc_*  (M > 8): BM x BN tiles, a cp.async pipeline of STAGES BK-wide slices in padded
//              shared rows, ldmatrix + mma.m16n8k16. Every tile shape runs the same ceil(K/16)
//              k16 steps, k = 0, 16, 32, ... in order, into one accumulator per output.

#include "decoder.cuh"

// ---------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
    return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}

// 16 bytes global -> shared, bypassing L1; zero-filled when !valid (src is then not read).
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(dst), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory");
}

// Four 8x8 fp16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, register i receives it.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address) : "memory");
}

// d += a (16x16, row-major) * b (16x8, column-major), fp16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes read once (weights): not kept in L1.
__device__ __forceinline__ uint4 load_streaming(const half* pointer) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(pointer));
    return v;
}

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
#define GEMV_WARPS 12     // warps per block, splitting K: one round of loads for K <= 1536
#define GEMV_UNROLL 4     // 32-wide K slices per warp with loads in flight

static_assert(GEMV_WARPS >= GEMV_MAX_ROWS, "a warp per x row for the RMSNorm prologue");

// x sources: prepare(M) once per block (all threads), then load(m, k): x[m, k..k+7] as 8 packed halves.
struct HalfRows {  // x [M, K] fp16
    const half* x;
    int K;
    __device__ __forceinline__ void prepare(int) const {}
    __device__ __forceinline__ uint4 load(int m, int k) const { return load_cached(x + (size_t)m * K + k); }
};

__device__ __forceinline__ unsigned pack(half lo, half hi) {
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
}

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
template <typename Source, typename Epilogue>
__device__ __forceinline__ void gemv(const Source& source, const half* __restrict__ w, int M, int N, int K, int span,
                                     const Epilogue& epilogue)
{
    __shared__ float partial[GEMV_WARPS][4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int group = lane >> 2, quad = lane & 3;   // mma fragment row group and thread in group
    const int lo_row = pair_row(blockIdx.x, group, span), hi_row = lo_row + span / 2;
    const bool lo_ok = lo_row < N, hi_ok = hi_row < N, x_ok = group < M;
    // This lane's 8 consecutive k of each slice: A rows group and group + 8 (weight rows lo_row and
    // hi_row), B column group (x row group); rows out of range are never read (zero values).
    const half* w_lo = w + (size_t)min(lo_row, N - 1) * K + 8 * quad;
    const half* w_hi = w + (size_t)min(hi_row, N - 1) * K + 8 * quad;
    const int slices = (K + 31) >> 5;

    uint4 lo[GEMV_UNROLL], hi[GEMV_UNROLL];
    auto load_weights = [&](int first) {
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int k = (first + u * GEMV_WARPS) * 32;
            const bool k_ok = k + 8 * quad < K;
            lo[u] = k_ok && lo_ok ? load_streaming(w_lo + k) : uint4{};
            hi[u] = k_ok && hi_ok ? load_streaming(w_hi + k) : uint4{};
        }
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
            mma_16816(acc, lo[u].x, hi[u].x, lo[u].y, hi[u].y, xv[u].x, xv[u].y);
            mma_16816(acc, lo[u].z, hi[u].z, lo[u].w, hi[u].w, xv[u].z, xv[u].w);
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

#define GEMV_KERNEL extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)

// Grids: ceil(N / 16) blocks of 384 threads; x, residual [M, K] with M <= 8.
GEMV_KERNEL gemv_f16(const half* __restrict__ x, const half* __restrict__ w, half* __restrict__ out,
                     int M, int N, int K)
{
    gemv(HalfRows{x, K}, w, M, N, K, GEMV_ROWS, Each<Store<half>>{{out, N}});
}

GEMV_KERNEL gemv_add(const half* __restrict__ x, const half* __restrict__ w, float* __restrict__ residual,
                     int M, int N, int K)
{
    gemv(HalfRows{x, K}, w, M, N, K, GEMV_ROWS, Each<AddToResidual>{{residual, N}});
}

// out = swiglu(RMSNorm(residual) @ w.T): w [2F, K] gate rows first, F % 8 == 0; out [M, F].
GEMV_KERNEL gemv_norm_swiglu(const float* __restrict__ residual, const float* __restrict__ norm_weight, float eps,
                             const half* __restrict__ w, half* __restrict__ out, int M, int N, int K)
{
    __shared__ float inv_rms[GEMV_MAX_ROWS];
    gemv(NormedRows{residual, norm_weight, eps, K, inv_rms}, w, M, N, K, N, SwiGLU{out, N / 2});
}

// RoPE and the KV-cache write of qkv = RMSNorm(residual) @ w.T (+ bias): w [(Hq + 2 Hkv) D, K],
// D % 16 == 0; q_out [M, Hq, D]; cos, sin [P, D/2]; positions, slots [M].
GEMV_KERNEL gemv_norm_rope(const float* __restrict__ residual, const float* __restrict__ norm_weight, float eps,
                           const half* __restrict__ w, const float* __restrict__ bias, int has_bias,
                           const float* __restrict__ cos, const float* __restrict__ sin,
                           const int* __restrict__ positions, const int* __restrict__ slots,
                           half* __restrict__ q_out, half* __restrict__ k_cache, half* __restrict__ v_cache,
                           int M, int N, int K, int num_kv_heads, int head_dim)
{
    __shared__ float inv_rms[GEMV_MAX_ROWS];
    const RopeCache rope{cos, sin, positions, slots, q_out, k_cache, v_cache,
                         N / head_dim - 2 * num_kv_heads, num_kv_heads, head_dim};
    gemv(NormedRows{residual, norm_weight, eps, K, inv_rms}, w, M, N, K, head_dim,
         Rope{rope, has_bias ? bias : nullptr});
}

// ---------------------------------------------------------------- gemm_tc: tensor-core tiles

// Block tile BM x BN, K slices of BK, WARPS_M x WARPS_N warps of (BM / WARPS_M) x (BN / WARPS_N).
// Dynamic shared memory: STAGES * (BM + BN) * (BK + 8) halves; rows padded by 16 bytes so that the
// 8 row addresses of an ldmatrix phase fall in distinct banks.
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, typename Epilogue>
__device__ __forceinline__ void gemm_tc(const half* __restrict__ x, const half* __restrict__ w, int M, int N, int K,
                                        const Epilogue& epilogue)
{
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int LD = BK + 8;                          // padded shared row, halves
    constexpr int CHUNKS = BK / 8;                      // 16-byte chunks per row of a slice
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int FM = WM / 16, FN = WN / 8;            // m16 and n8 fragments per warp
    static_assert(BK % 16 == 0 && WM % 16 == 0 && FN % 2 == 0, "ldmatrix.x4 loads two n8 fragments of B");
    static_assert((BM * CHUNKS) % THREADS == 0 && (BN * CHUNKS) % THREADS == 0, "whole chunks per thread");
    static_assert(STAGES >= 2, "a pipeline");

    release_dependent_grid();
    wait_for_prior_grid();
    extern __shared__ uint4 shared_raw[];
    half* const sx = reinterpret_cast<half*>(shared_raw);   // [STAGES][BM][LD]
    half* const sw = sx + STAGES * BM * LD;                 // [STAGES][BN][LD]

    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;   // x: row tiles fastest, so w tiles are reused in L2
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;

    // One BK slice of x and w into a stage; chunks past M, N or K are zero-filled.
    auto load_slice = [&](int stage, int k0) {
        half* const dx = sx + stage * BM * LD;
        half* const dw = sw + stage * BN * LD;
#pragma unroll
        for (int j = 0; j < BM * CHUNKS / THREADS; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / CHUNKS, k = k0 + (i % CHUNKS) * 8;
            const bool ok = m0 + r < M && k < K;
            cp_async_16(shared_address(dx + r * LD + (i % CHUNKS) * 8), ok ? x + (size_t)(m0 + r) * K + k : x, ok);
        }
#pragma unroll
        for (int j = 0; j < BN * CHUNKS / THREADS; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / CHUNKS, k = k0 + (i % CHUNKS) * 8;
            const bool ok = n0 + r < N && k < K;
            cp_async_16(shared_address(dw + r * LD + (i % CHUNKS) * 8), ok ? w + (size_t)(n0 + r) * K + k : w, ok);
        }
    };

    const int slices = (K + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < slices) load_slice(s, s * BK);
        cp_async_commit();   // possibly empty: one group per slice keeps the wait count uniform
    }

    float acc[FM][FN][4] = {};
    for (int s = 0; s < slices; ++s) {
        cp_async_wait<STAGES - 2>();   // slice s has landed (this thread's part) ...
        __syncthreads();               // ... everyone's part, and slice s - 1's stage is free
        if (s + STAGES - 1 < slices) load_slice((s + STAGES - 1) % STAGES, (s + STAGES - 1) * BK);
        cp_async_commit();

        const half* const tx = sx + (s % STAGES) * BM * LD;
        const half* const tw = sw + (s % STAGES) * BN * LD;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            if (s * BK + kk >= K) break;   // exactly ceil(K / 16) k16 steps, whatever BK
            unsigned a[FM][4], b[FN][2];
            // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15)
#pragma unroll
            for (int fm = 0; fm < FM; ++fm) {
                ldmatrix_x4(a[fm], shared_address(tx + (wm + fm * 16 + (lane & 15)) * LD + kk + (lane >> 4) * 8));
            }
            // B = w^T: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
#pragma unroll
            for (int fn = 0; fn < FN; fn += 2) {
                unsigned r[4];
                ldmatrix_x4(r, shared_address(tw + (wn + fn * 8 + (lane >> 4) * 8 + (lane & 7)) * LD + kk
                                              + ((lane >> 3) & 1) * 8));
                b[fn][0] = r[0];
                b[fn][1] = r[1];
                b[fn + 1][0] = r[2];
                b[fn + 1][1] = r[3];
            }
#pragma unroll
            for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
                for (int fn = 0; fn < FN; ++fn) {
                    mma_16816(acc[fm][fn], a[fm][0], a[fm][1], a[fm][2], a[fm][3], b[fn][0], b[fn][1]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // acc[fm][fn] = D[g][2q], D[g][2q+1], D[g+8][2q], D[g+8][2q+1] of the fragment's 16 x 8
    const int group = lane >> 2, quad = lane & 3;
#pragma unroll
    for (int fm = 0; fm < FM; ++fm) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int m = m0 + wm + fm * 16 + group + 8 * h;
            if (m >= M) continue;
#pragma unroll
            for (int fn = 0; fn < FN; ++fn) {
                adjacent(epilogue, m, n0 + wn + fn * 8 + 2 * quad, acc[fm][fn][2 * h], acc[fm][fn][2 * h + 1]);
            }
        }
    }
}

// Entry points gemm_tc_<BM>x<BN>_f16 / _f32 / _add (out: residual [M, N] fp32): grid (ceil(M / BM),
// ceil(N / BN)), 32 * WARPS_M * WARPS_N threads, STAGES * (BM + BN) * (BK + 8) * 2 bytes of dynamic
// shared memory. cupyspec/model/linear.py holds the same parameters.
#define GEMM_TC_ENTRY(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, SUFFIX, OUT, EPILOGUE)               \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_M * WARPS_N, MIN_BLOCKS) gemm_tc_##BM##x##BN##_##SUFFIX( \
        const half* __restrict__ x, const half* __restrict__ w, OUT* __restrict__ out, int M, int N, int K)   \
    {                                                                                                       \
        gemm_tc<BM, BN, BK, WARPS_M, WARPS_N, STAGES>(x, w, M, N, K, EPILOGUE{out, N});                     \
    }
#define GEMM_TC(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS)                                           \
    GEMM_TC_ENTRY(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, f16, half, Store<half>)                 \
    GEMM_TC_ENTRY(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, f32, float, Store<float>)               \
    GEMM_TC_ENTRY(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, add, float, AddToResidual)

GEMM_TC(32, 64, 64, 2, 2, 4, 1)     // M <= 64 or few tiles: 128 threads, 54 KB
GEMM_TC(64, 128, 32, 2, 4, 4, 1)    // 256 threads, 60 KB
GEMM_TC(128, 128, 32, 2, 4, 4, 2)   // 256 threads, 80 KB, two blocks per SM
