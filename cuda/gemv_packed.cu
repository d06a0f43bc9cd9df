// Weight-only quantization's kernels (twins: cupyspec/model/quantized.py and linear.py): the gemv
// products of gemv.cuh over packed weights (entry points gemv_*_wint8, gemv_*_wint4), and the
// dequantization of a whole matrix to fp16 for products of more rows, which then run on fp16 weights.

#include "gemv.cuh"

GEMV_ENTRY_POINTS(_wint8, Int8Weights)
GEMV_ENTRY_POINTS(_wint4, Int4Weights)

// out [N, K] fp16 = the weights of a packed matrix; grid: ceil(N K / 8 / 256) blocks of 256 threads,
// each thread writing 8 consecutive weights of a row.
template <typename Weights>
__device__ __forceinline__ void dequantize(const Weights& weights, uint4* __restrict__ out, int N, int K) {
    const long long chunk = (long long)blockIdx.x * blockDim.x + threadIdx.x, per_row = K / 8;
    release_dependent_grid();
    if (chunk >= (long long)N * per_row) return;
    const typename Weights::Raw raw = weights.fetch((int)(chunk / per_row), (int)(chunk % per_row) * 8);
    wait_for_prior_grid();  // out may be memory a kernel before this one still reads
    out[chunk] = weights.expand(raw);
}

extern "C" __global__ void __launch_bounds__(256) dequantize_wint8(const void* __restrict__ q, const void* __restrict__ scales,
                                                                   uint4* __restrict__ out, int N, int K) {
    dequantize(Int8Weights(q, scales, K), out, N, K);
}

extern "C" __global__ void __launch_bounds__(256) dequantize_wint4(const void* __restrict__ q, const void* __restrict__ scales,
                                                                   uint4* __restrict__ out, int N, int K) {
    dequantize(Int4Weights(q, scales, K), out, N, K);
}
