// RMSNorm of the fp32 residual stream; twin: rms_norm in cupyspec/model/ops.py.
//
// One warp per row: out[t] = fp16(residual[t] * inv_rms * weight), inv_rms = warp_inv_rms(residual[t])
// in fp32, the arithmetic the gemv kernels of gemm.cu use for their RMSNorm prologue.

#include "decoder.cuh"

#define WARPS 4

extern "C" __global__ void __launch_bounds__(WARPS * 32) rms_norm(
    const float* __restrict__ residual,  // [T, H] fp32, H % 4 == 0
    const float* __restrict__ weight,    // [H]
    half* __restrict__ out,              // [T, H]
    int num_tokens, int hidden, float eps)  // grid: ceil(T / 4) blocks of 128 threads
{
    release_dependent_grid();
    wait_for_prior_grid();
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= num_tokens) return;
    const float* x = residual + (long long)row * hidden;
    const float inv_rms = warp_inv_rms(x, hidden, eps);
    half2* y = reinterpret_cast<half2*>(out + (long long)row * hidden);
    for (int c = threadIdx.x & 31; c < hidden / 4; c += 32) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(x) + c);
        const float4 w = __ldg(reinterpret_cast<const float4*>(weight) + c);
        y[2 * c] = __halves2half2(normed(v.x, inv_rms, w.x), normed(v.y, inv_rms, w.y));
        y[2 * c + 1] = __halves2half2(normed(v.z, inv_rms, w.z), normed(v.w, inv_rms, w.w));
    }
}
