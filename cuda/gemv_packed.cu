// Weight-only quantization's kernels (twins: cupyspec/model/quantized.py and linear.py): the gemv
// products of gemv.cuh over packed weights (entry points gemv_*_wint8, gemv_*_wint4), and the
// dequantization of a whole matrix to fp16 for products of more rows, which then run on fp16 weights.

#include "gemv.cuh"

// two blocks an SM: the packed lanes' registers would otherwise leave room for one
GEMV_ENTRY_POINTS(_wint8, Int8Weights, __launch_bounds__(GEMV_WARPS * 32, 2))
GEMV_ENTRY_POINTS(_wint4, Int4Weights, __launch_bounds__(GEMV_WARPS * 32, 2))

// out [N, K] fp16 = the weights of a packed matrix; grid: ceil(N lanes / 256) blocks of 256 threads,
// lanes = ceil(K / 32 / ROUND) GEMV_WARPS 4 per row: each thread expands what a gemv lane reads of a
// row's round, 8 weights of each of its GEMV_UNROLL slices.
template <typename Weights>
__device__ __forceinline__ void dequantize(const Weights& weights, uint4* __restrict__ out, int N, int K) {
    const int slices = K / 32;
    const long long lane = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long per_row = (long long)(slices + ROUND - 1) / ROUND * GEMV_WARPS * 4;
    release_dependent_grid();
    if (lane >= N * per_row) return;
    const int row = (int)(lane / per_row), at = (int)(lane % per_row), quad = at % 4;
    const int first = at / 4 / GEMV_WARPS * ROUND + at / 4 % GEMV_WARPS;  // the round's slice of warp at / 4
    const typename Weights::Raw raw = weights.fetch(row, first, quad);
    wait_for_prior_grid();  // out may be memory a kernel before this one still reads
#pragma unroll
    for (int u = 0; u < GEMV_UNROLL; ++u) {
        const int slice = first + u * GEMV_WARPS;
        if (slice < slices) out[((size_t)row * K + slice * 32 + 8 * quad) / 8] = weights.expand(raw, u);
    }
}

extern "C" __global__ void __launch_bounds__(256) dequantize_wint8(const void* __restrict__ q, const void* __restrict__ scales,
                                                                   uint4* __restrict__ out, int N, int K) {
    dequantize(Int8Weights(q, scales, K), out, N, K);
}

extern "C" __global__ void __launch_bounds__(256) dequantize_wint4(const void* __restrict__ q, const void* __restrict__ scales,
                                                                   uint4* __restrict__ out, int N, int K) {
    dequantize(Int4Weights(q, scales, K), out, N, K);
}
