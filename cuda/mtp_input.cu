// The MTP head's input rows in one kernel: concat(RMSNorm(embed[x]; enorm), RMSNorm(h; hnorm)), fp16;
// twin: MTPHead._input_rows in cupyspec/model/mtp.py (embed_tokens, rms_norm and a concatenation).
//
// One warp per row. x may be a placeholder ~n for previous[n] (cuda/embedding.cu). The embedding row
// is widened to fp32 and normed with the arithmetic of cuda/rms_norm.cu (decoder.cuh), as is h.

#include "decoder.cuh"

#define WARPS 4

__device__ __forceinline__ float warp_inv_rms_half(const half2* __restrict__ row, int hidden, float eps) {
    float sum = 0.0f;
    for (int c = threadIdx.x & 31; c < hidden / 4; c += 32) {
        const float2 a = __half22float2(row[2 * c]), b = __half22float2(row[2 * c + 1]);
        sum = fmaf(a.x, a.x, sum);
        sum = fmaf(a.y, a.y, sum);
        sum = fmaf(b.x, b.x, sum);
        sum = fmaf(b.y, b.y, sum);
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
    return 1.0f / sqrtf(sum / hidden + eps);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) mtp_input(
    const half* __restrict__ table,      // [V, H] the target's embedding
    const int* __restrict__ ids,         // [T] the token after each row, or ~n for previous[n]
    const int* __restrict__ previous,    // [N]
    const float* __restrict__ hidden,    // [T, H] fp32
    const float* __restrict__ enorm,     // [H]
    const float* __restrict__ hnorm,     // [H]
    half* __restrict__ out,              // [T, 2H]
    int num_tokens, int width, float eps)  // width = H, H % 4 == 0
{
    release_dependent_grid();
    wait_for_prior_grid();
    const int row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= num_tokens) return;
    int id = ids[row];
    if (id < 0) id = previous[~id];
    const half2* e = reinterpret_cast<const half2*>(table + (long long)id * width);
    const float* h = hidden + (long long)row * width;
    const float inv_e = warp_inv_rms_half(e, width, eps), inv_h = warp_inv_rms(h, width, eps);
    half2* y = reinterpret_cast<half2*>(out + (long long)row * 2 * width);
    for (int c = threadIdx.x & 31; c < width / 4; c += 32) {
        const float2 a = __half22float2(e[2 * c]), b = __half22float2(e[2 * c + 1]);
        const float4 w = __ldg(reinterpret_cast<const float4*>(enorm) + c);
        y[2 * c] = __halves2half2(normed(a.x, inv_e, w.x), normed(a.y, inv_e, w.y));
        y[2 * c + 1] = __halves2half2(normed(b.x, inv_e, w.z), normed(b.y, inv_e, w.w));
        const float4 v = __ldg(reinterpret_cast<const float4*>(h) + c);
        const float4 u = __ldg(reinterpret_cast<const float4*>(hnorm) + c);
        y[width / 2 + 2 * c] = __halves2half2(normed(v.x, inv_h, u.x), normed(v.y, inv_h, u.y));
        y[width / 2 + 2 * c + 1] = __halves2half2(normed(v.z, inv_h, u.z), normed(v.w, inv_h, u.w));
    }
}
