// gemm_tc: tensor-core tiles of out = x @ w.T for products of more than 8 rows; gemm.cu instantiates
// them over fp16 weights, quantized.cu over packed ones. Twin: linear in cupyspec/model/linear.py.
//
// BM x BN tiles, a cp.async pipeline of STAGES BK-wide slices in padded shared rows, ldmatrix +
// mma.m16n8k16. Every tile shape runs the same ceil(K/16) k16 steps, k = 0, 16, 32, ... in order, into
// one accumulator per output. A weight-tile policy brings each slice of w in: fp16 rows as they are
// (HalfTiles), or packed words and (s, m) made into fp16 rows in shared memory before the slice's
// products (PackedTiles). Both give the products the same fp16 weights, so packed and dequantized
// weights give the same bits.

#pragma once

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

// BYTES (4 or 8) global -> shared through L1; zero-filled when !valid.
template <int BYTES>
__device__ __forceinline__ void cp_async_small(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                 :: "r"(dst), "l"(src), "n"(BYTES), "r"(valid ? BYTES : 0) : "memory");
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

// ---------------------------------------------------------------- weight-tile policies

// A policy holds a block's weight slices in shared memory (SHARED_BYTES, after x's stages):
// load(stage, n0, k0, N) issues the cp.async copies of rows n0.. and k0..k0 + BK - 1 into a stage
// (zeros past N and K); tile(stage), once that stage has landed for every thread, gives the slice as
// fp16 rows [BN][BK + 8] (padded by 16 bytes so that an ldmatrix phase's 8 rows fall in distinct banks).

template <int BN, int BK, int STAGES, int THREADS>
struct HalfTiles {  // w [N, K] fp16, K % 8 == 0: each stage is a tile
    static constexpr int LD = BK + 8, CHUNKS = BK / 8;  // 16-byte chunks per row of a slice
    static constexpr int SHARED_BYTES = STAGES * BN * LD * 2;
    static_assert((BN * CHUNKS) % THREADS == 0, "whole chunks per thread");
    const half* w;
    int K;
    half* stages;  // [STAGES][BN][LD]
    __device__ HalfTiles(const void* values, const void*, int K, void* shared)
        : w(static_cast<const half*>(values)), K(K), stages(static_cast<half*>(shared)) {}

    __device__ __forceinline__ void load(int stage, int n0, int k0, int N) const {
        half* const dw = stages + stage * BN * LD;
#pragma unroll
        for (int j = 0; j < BN * CHUNKS / THREADS; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / CHUNKS, k = k0 + (i % CHUNKS) * 8;
            const bool ok = n0 + r < N && k < K;
            cp_async_16(shared_address(dw + r * LD + (i % CHUNKS) * 8), ok ? w + (size_t)(n0 + r) * K + k : w, ok);
        }
    }
    __device__ __forceinline__ const half* tile(int stage) const { return stages + stage * BN * LD; }
};

// Packed weights (packed_weights.cuh), K % 32 == 0, BK % 32 == 0: each stage holds a slice's words (a
// word: 8 weights in BITS bytes) and each row's (s, m) per group; tile() makes them the fp16 rows of
// one tile, then waits for the block, since every warp reads every row. A thread copies and expands
// the same word of every ROWS_APART-th row, so that its addresses are worked out once a slice.
template <int BITS, int BN, int BK, int STAGES, int THREADS>
struct PackedTiles {
    static constexpr int LD = BK + 8, WORDS = BK / 8, GROUPS = BK / 32;  // per row of a slice
    static constexpr int WORD = BITS;                                     // bytes of a word of 8 weights
    static constexpr int COPIES = BN * WORDS / THREADS, ROWS_APART = THREADS / WORDS;
    static constexpr int STAGE_BYTES = BN * (WORDS * WORD + GROUPS * 4);
    static constexpr int SHARED_BYTES = BN * LD * 2 + STAGES * STAGE_BYTES;
    static_assert(BK % 32 == 0, "whole groups per slice");
    static_assert(BN * WORDS % THREADS == 0 && THREADS % WORDS == 0 && BN * GROUPS <= THREADS,
                  "every thread copies the same word of COPIES rows; one (s, m) at most");
    const PackedWeights<BITS> weights;
    half* made;                    // [BN][LD]: the tile
    unsigned char* stages;         // [STAGES]: words [BN][WORDS][WORD], then (s, m) [BN][GROUPS]
    __device__ PackedTiles(const void* values, const void* scales, int K, void* shared)
        : weights(values, scales, K), made(static_cast<half*>(shared)),
          stages(static_cast<unsigned char*>(shared) + BN * LD * 2) {}

    __device__ __forceinline__ unsigned char* words(int stage) const { return stages + stage * STAGE_BYTES; }
    __device__ __forceinline__ unsigned* scale_min(int stage) const {
        return reinterpret_cast<unsigned*>(words(stage) + BN * WORDS * WORD);
    }

    // Thread t copies word t % WORDS of rows t / WORDS + j ROWS_APART (j < COPIES), and (s, m) t.
    __device__ __forceinline__ void load(int stage, int n0, int k0, int N) const {
        const int K = weights.K, slices = K / 32, word = threadIdx.x % WORDS, k = k0 + 8 * word;
        const int row = n0 + threadIdx.x / WORDS;
        const unsigned char* const at = weights.word_address(0, k / 32, word % 4, slices);  // of row 0
        const size_t row_bytes = (size_t)K * BITS / 8;
        unsigned char* const to = words(stage) + threadIdx.x * WORD;
#pragma unroll
        for (int j = 0; j < COPIES; ++j) {
            const bool ok = row + j * ROWS_APART < N && k < K;
            cp_async_small<WORD>(shared_address(to + j * THREADS * WORD),
                                 ok ? at + (row + j * ROWS_APART) * row_bytes : weights.q, ok);
        }
        if (threadIdx.x < BN * GROUPS) {
            const int scale_row = n0 + threadIdx.x / GROUPS, slice = k0 / 32 + threadIdx.x % GROUPS;
            const bool ok = scale_row < N && slice < slices;
            cp_async_small<4>(shared_address(scale_min(stage) + threadIdx.x),
                              ok ? weights.scale_address(scale_row, slice, slices) : weights.scale_min, ok);
        }
    }

    __device__ __forceinline__ const half* tile(int stage) const {
        const int word = threadIdx.x % WORDS, row = threadIdx.x / WORDS;
        const unsigned char* const from = words(stage) + threadIdx.x * WORD;
        const unsigned* const group = scale_min(stage) + row * GROUPS + word / 4;
        half* const to = made + row * LD + word * 8;
#pragma unroll
        for (int j = 0; j < COPIES; ++j) {
            const unsigned* halves = reinterpret_cast<const unsigned*>(from + j * THREADS * WORD);  // WORD / 4
            *reinterpret_cast<uint4*>(to + j * ROWS_APART * LD) = PackedWeights<BITS>::expand_word(
                halves[0], WORD == 8 ? halves[1] : 0u, group[j * ROWS_APART * GROUPS]);
        }
        __syncthreads();
        return made;
    }
};

template <int BN, int BK, int STAGES, int THREADS>
using Int8Tiles = PackedTiles<8, BN, BK, STAGES, THREADS>;
template <int BN, int BK, int STAGES, int THREADS>
using Int4Tiles = PackedTiles<4, BN, BK, STAGES, THREADS>;

// ---------------------------------------------------------------- gemm_tc

// Block tile BM x BN, K slices of BK, WARPS_M x WARPS_N warps of (BM / WARPS_M) x (BN / WARPS_N).
// Dynamic shared memory: x's STAGES * BM * (BK + 8) halves, then the weight tiles' SHARED_BYTES.
template <int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES, typename Tiles, typename Epilogue>
__device__ __forceinline__ void gemm_tc(const half* __restrict__ x, const void* __restrict__ w,
                                        const void* __restrict__ scales, int M, int N, int K, const Epilogue& epilogue)
{
    constexpr int THREADS = 32 * WARPS_M * WARPS_N;
    constexpr int LD = BK + 8;                          // padded shared row, halves
    constexpr int CHUNKS = BK / 8;                      // 16-byte chunks per row of a slice
    constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N;
    constexpr int FM = WM / 16, FN = WN / 8;            // m16 and n8 fragments per warp
    static_assert(BK % 16 == 0 && WM % 16 == 0 && FN % 2 == 0, "ldmatrix.x4 loads two n8 fragments of B");
    static_assert((BM * CHUNKS) % THREADS == 0, "whole chunks per thread");
    static_assert(STAGES >= 2, "a pipeline");

    release_dependent_grid();
    wait_for_prior_grid();
    extern __shared__ uint4 shared_raw[];
    half* const sx = reinterpret_cast<half*>(shared_raw);   // [STAGES][BM][LD]
    const Tiles tiles(w, scales, K, sx + STAGES * BM * LD);

    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;   // x: row tiles fastest, so w tiles are reused in L2
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = (warp / WARPS_N) * WM, wn = (warp % WARPS_N) * WN;

    // One BK slice of x and w into a stage; chunks past M, N or K are zero-filled.
    auto load_slice = [&](int stage, int k0) {
        half* const dx = sx + stage * BM * LD;
#pragma unroll
        for (int j = 0; j < BM * CHUNKS / THREADS; ++j) {
            const int i = threadIdx.x + j * THREADS, r = i / CHUNKS, k = k0 + (i % CHUNKS) * 8;
            const bool ok = m0 + r < M && k < K;
            cp_async_16(shared_address(dx + r * LD + (i % CHUNKS) * 8), ok ? x + (size_t)(m0 + r) * K + k : x, ok);
        }
        tiles.load(stage, n0, k0, N);
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
        __syncthreads();               // ... everyone's part, and slice s - 1's stage and tile are free
        if (s + STAGES - 1 < slices) load_slice((s + STAGES - 1) % STAGES, (s + STAGES - 1) * BK);
        cp_async_commit();

        const half* const tx = sx + (s % STAGES) * BM * LD;
        const half* const tw = tiles.tile(s % STAGES);
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

// Entry points gemm_tc_<BM>x<BN>_f16 / _f32 / _add, each name followed by SUFFIX (out: residual [M, N]
// fp32; w and scales as TILES takes them): grid (ceil(M / BM), ceil(N / BN)), 32 * WARPS_M * WARPS_N
// threads, STAGES * BM * (BK + 8) * 2 + TILES' SHARED_BYTES bytes of dynamic shared memory.
// cupyspec/model/linear.py holds the same parameters.
#define GEMM_TC_ENTRY(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, TILES, SUFFIX, OUT, EPILOGUE)              \
    extern "C" __global__ void __launch_bounds__(32 * WARPS_M * WARPS_N, MIN_BLOCKS) gemm_tc_##BM##x##BN##SUFFIX( \
        const half* __restrict__ x, const void* __restrict__ w, const void* __restrict__ scales,              \
        OUT* __restrict__ out, int M, int N, int K)                                                           \
    {                                                                                                         \
        gemm_tc<BM, BN, BK, WARPS_M, WARPS_N, STAGES, TILES<BN, BK, STAGES, 32 * WARPS_M * WARPS_N>>(         \
            x, w, scales, M, N, K, EPILOGUE{out, N});                                                         \
    }
#define GEMM_TC(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, TILES, SUFFIX)                                 \
    GEMM_TC_ENTRY(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, TILES, _f16##SUFFIX, half, Store<half>)      \
    GEMM_TC_ENTRY(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, TILES, _f32##SUFFIX, float, Store<float>)    \
    GEMM_TC_ENTRY(BM, BN, BK, WARPS_M, WARPS_N, STAGES, MIN_BLOCKS, TILES, _add##SUFFIX, float, AddToResidual)

// The tile shapes, the same for every weight format (cupyspec/model/linear.py's _TILES).
#define GEMM_TC_SHAPES(TILES, SUFFIX)                      \
    GEMM_TC(32, 64, 64, 2, 2, 4, 1, TILES, SUFFIX)         \
    GEMM_TC(64, 96, 32, 2, 2, 4, 2, TILES, SUFFIX)         \
    GEMM_TC(128, 96, 32, 2, 2, 4, 2, TILES, SUFFIX)        \
    GEMM_TC(128, 192, 32, 2, 4, 4, 2, TILES, SUFFIX)
