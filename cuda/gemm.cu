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
//   gemm_tc_*  (M > 8): gemm_tc.cuh's tiles; every tile shape sums in the same order.
//
// Both take the weights as (w, scales); fp16 weights leave scales unread (linear.py passes w twice).

#include "gemm_tc.cuh"

// ---------------------------------------------------------------- gemv over fp16 weights

GEMV_ENTRY_POINTS(, HalfWeights, __launch_bounds__(GEMV_WARPS * 32))

// ---------------------------------------------------------------- gemm_tc over fp16 weights

GEMM_TC_SHAPES(HalfTiles, )
