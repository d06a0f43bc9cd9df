// The arithmetic of the decoder's element-wise steps, shared by their own kernels (rms_norm.cu,
// rope_cache.cu, swiglu.cu) and the gemv kernels that fuse them into a matrix product (gemm.cu), so
// that a fused and a separate step give the same bits. All in fp32 without contraction; twins in
// cupyspec/model/ops.py.

#pragma once

#include <cuda_fp16.h>

#include "grid_dependency.cuh"

// 1 / sqrt(mean(row^2) + eps) of row [hidden] fp32 (hidden % 4 == 0, 16-byte aligned, read-only),
// computed by one warp and returned to every lane: lane l sums the squares of the float4 chunks
// l, l + 32, ... in order, then the lanes' sums meet in a butterfly (the same bits in every lane).
__device__ __forceinline__ float warp_inv_rms(const float* __restrict__ row, int hidden, float eps) {
    const float4* chunks = reinterpret_cast<const float4*>(row);
    float sum = 0.0f;
    for (int c = threadIdx.x & 31; c < hidden / 4; c += 32) {
        const float4 v = __ldg(chunks + c);
        sum = fmaf(v.x, v.x, sum);
        sum = fmaf(v.y, v.y, sum);
        sum = fmaf(v.z, v.z, sum);
        sum = fmaf(v.w, v.w, sum);
    }
    for (int offset = 16; offset > 0; offset >>= 1) sum = __fadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, offset));
    return 1.0f / sqrtf(sum / hidden + eps);
}

// One element of RMSNorm: x * inv_rms * weight, rounded to fp16.
__device__ __forceinline__ half normed(float x, float inv_rms, float weight) {
    return __float2half_rn(__fmul_rn(__fmul_rn(x, inv_rms), weight));
}

// SwiGLU of one element: silu(gate) * up.
__device__ __forceinline__ float silu_mul(float gate, float up) {
    return __fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), up);
}

// Rotate-half RoPE of the qkv heads of a row and their paged KV-cache write. Heads 0..Hq-1 of a qkv
// row are q, then Hkv k heads, then Hkv v heads, each of head_dim D; dims i and i + D/2 form a pair.
struct RopeCache {
    const float* cos;    // [P, D/2] by position
    const float* sin;    // [P, D/2]
    const int* positions;  // [T]
    const int* slots;    // [T] block * block_size + offset
    half* q_out;         // [T, Hq, D]
    half* k_cache;       // [slots, Hkv, D] this layer's
    half* v_cache;       // [slots, Hkv, D]
    int num_heads, num_kv_heads, head_dim;

    // The pair (x1, x2) = dims (i, i + D/2) of head `head` of row t (fp16 values): q and k rotated,
    // (x1 c - x2 s, x2 c + x1 s) with the angle of the row's position; q to q_out, k and v to the
    // row's cache slot.
    __device__ __forceinline__ void store(long long t, int head, int i, float x1, float x2) const {
        const int half_dim = head_dim / 2;
        if (head >= num_heads + num_kv_heads) {  // v: as it is
            half* dst = v_cache + ((long long)slots[t] * num_kv_heads + head - num_heads - num_kv_heads) * head_dim;
            dst[i] = __float2half_rn(x1);
            dst[i + half_dim] = __float2half_rn(x2);
            return;
        }
        const long long angle = (long long)positions[t] * half_dim + i;
        const float c = cos[angle], s = sin[angle];
        half* dst = head < num_heads ? q_out + (t * num_heads + head) * head_dim
                                     : k_cache + ((long long)slots[t] * num_kv_heads + head - num_heads) * head_dim;
        dst[i] = __float2half_rn(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
        dst[i + half_dim] = __float2half_rn(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
};
