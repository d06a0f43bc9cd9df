// Matrix products out = x @ w.T on tensor cores with fp16 weights; twin: linear in
// cupyspec/model/linear.py.
//
// out[m, n] = sum_k x[m, k] * w[n, k]: x [M, K] and w [N, K] (Hugging Face [out, in] layout) fp16,
// row-major, contiguous, 16-byte aligned, K % 8 == 0; any M, N >= 1. Products are summed in fp32;
// the epilogue stores them as fp16 (round to nearest, entry points *_f16) or as fp32 (*_f32), or adds
// them, rounded to fp16, to an fp32 residual stream (*_add).
//
// No split-K and no dependence on the batch: out[m, n] is a function of x[m, :] and w[n, :] alone,
// whatever M is, so that rows padded into a larger batch (CUDA graphs of fixed sizes) come out
// bit-identical. Within a family the order of the fp32 sums is fixed by K alone:
//
//   gemv_*     (M <= 8, decode): gemv.cuh, which also fuses the decoder steps around a product.
//   gemm_tc_*  (M > 8): BM x BN tiles, a cp.async pipeline of STAGES BK-wide slices in padded
//              shared rows, ldmatrix + mma.m16n8k16. Every tile shape runs the same ceil(K/16)
//              k16 steps, k = 0, 16, 32, ... in order, into one accumulator per output.

#include "gemv.cuh"

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


// ---------------------------------------------------------------- gemv over fp16 weights

GEMV_ENTRY_POINTS(, HalfWeights, __launch_bounds__(GEMV_WARPS * 32))

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
GEMM_TC(64, 96, 32, 2, 2, 4, 2)     // 128 threads, 50 KB
GEMM_TC(128, 96, 32, 2, 2, 4, 2)    // 128 threads, 70 KB
GEMM_TC(128, 192, 32, 2, 4, 4, 2)   // 256 threads, 100 KB, two blocks per SM
