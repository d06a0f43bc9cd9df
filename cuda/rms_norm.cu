// Residual add fused with RMSNorm; twin: add_rms_norm in cupyspec/model/fused.py.
//
// One block per token row: residual[t] += delta[t] (fp16, when has_delta), then
// out[t] = fp16(residual[t] * rsqrt(mean(residual[t]^2) + eps) * weight), all in fp32.

#include <cuda_fp16.h>

#define THREADS 256

extern "C" __global__ void __launch_bounds__(THREADS) add_rms_norm(
    float* __restrict__ residual,        // [T, H] fp32, updated in place
    const half* __restrict__ delta,      // [T, H] fp16; read only when has_delta
    const float* __restrict__ weight,    // [H]
    half* __restrict__ out,              // [T, H]
    int has_delta, int hidden, float eps)
{
    __shared__ float warp_sums[THREADS / 32];
    const long long row = (long long)blockIdx.x * hidden;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += THREADS) {
        float value = residual[row + i];
        if (has_delta) value = __fadd_rn(value, __half2float(delta[row + i]));
        residual[row + i] = value;
        sum += value * value;
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffff, sum, offset);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        sum = threadIdx.x < THREADS / 32 ? warp_sums[threadIdx.x] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_down_sync(0xffffffff, sum, offset);
        if (threadIdx.x == 0) warp_sums[0] = sum;
    }
    __syncthreads();
    const float inv_rms = 1.0f / sqrtf(warp_sums[0] / hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += THREADS)
        out[row + i] = __float2half(__fmul_rn(__fmul_rn(residual[row + i], inv_rms), weight[i]));
}
