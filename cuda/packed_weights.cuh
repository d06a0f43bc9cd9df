// Weight matrices w [N, K] as the gemv kernels read them: fp16, or packed for weight-only
// quantization (twin: cupyspec/model/quantized.py). Packed matrices hold groups of 32 weights along K,
// K % 32 == 0, each with an fp16 scale and minimum (s, m) ([N, K/32, 2]):  w = fp16(fmaf(s, q, m))
//
//   wint8: q [N, K] int8 (in [-127, 127] with m = 0, or in [0, 31])
//   wint4: q [N, K/2] uint8, q of k and k + 1 in the low and high nibble of byte k/2, in [0, 15]
//
// in fp32, where s q is exact: the fp16 values of GGUF blocks of these levels (Q8_0, Q5_0, Q5_1, Q4_0
// and Q4_1; s may be negative).
// A source gives 8 consecutive weights of one row (k % 8 == 0) in two steps, so that its loads stay
// in flight meanwhile: fetch(row, k) issues them (a Raw value; Raw{} reads as zeros), expand(raw)
// makes the 8 packed halves, the lower k in the lower half of each word.

#pragma once

#include <cuda_fp16.h>

__device__ __forceinline__ unsigned pack(half lo, half hi) {
    return (unsigned)__half_as_ushort(lo) | ((unsigned)__half_as_ushort(hi) << 16);
}

// Weights are read once per product: the loads bypass L1.
__device__ __forceinline__ uint4 load_streaming(const void* pointer) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(pointer));
    return v;
}

__device__ __forceinline__ uint2 load_streaming_8(const void* pointer) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(pointer));
    return v;
}

__device__ __forceinline__ unsigned load_streaming_4(const void* pointer) {
    unsigned v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(pointer));
    return v;
}

struct HalfWeights {  // w [N, K] fp16 (the scales argument is unused)
    const half* w;
    int K;
    __device__ HalfWeights(const void* values, const void*, int K) : w(static_cast<const half*>(values)), K(K) {}
    using Raw = uint4;
    __device__ __forceinline__ Raw fetch(int row, int k) const { return load_streaming(w + (size_t)row * K + k); }
    __device__ __forceinline__ uint4 expand(const Raw& raw) const { return raw; }
};

// The 8 weights fmaf(s, q_i, m) of a group's scale and minimum, packed as halves: q(i) gives q_i.
template <typename Q>
__device__ __forceinline__ uint4 scaled(unsigned scale_min, Q q) {
    const float s = __half2float(__ushort_as_half((unsigned short)(scale_min & 0xffff)));
    const float m = __half2float(__ushort_as_half((unsigned short)(scale_min >> 16)));
    unsigned out[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
        out[i] = pack(__float2half_rn(fmaf(q(2 * i), s, m)), __float2half_rn(fmaf(q(2 * i + 1), s, m)));
    return uint4{out[0], out[1], out[2], out[3]};
}

struct Int8Weights {  // wint8
    const signed char* q;       // [N, K]
    const unsigned* scale_min;  // [N, K/32] pairs of fp16 (s, m), s in the low half
    int K;
    __device__ Int8Weights(const void* values, const void* s, int K)
        : q(static_cast<const signed char*>(values)), scale_min(static_cast<const unsigned*>(s)), K(K) {}
    struct Raw {
        uint2 q;
        unsigned scale_min;
    };
    __device__ __forceinline__ Raw fetch(int row, int k) const {
        return Raw{load_streaming_8(q + (size_t)row * K + k), __ldg(scale_min + (size_t)row * (K / 32) + k / 32)};
    }
    __device__ __forceinline__ uint4 expand(const Raw& raw) const {  // weight j: byte j % 4 of word j / 4
        return scaled(raw.scale_min, [&](int j) {
            return (float)(signed char)(((j < 4 ? raw.q.x : raw.q.y) >> (8 * (j & 3))) & 0xff);
        });
    }
};

struct Int4Weights {  // wint4
    const unsigned char* q;    // [N, K/2]
    const unsigned* scale_min;  // [N, K/32] pairs of fp16 (s, m), s in the low half
    int K;
    __device__ Int4Weights(const void* values, const void* s, int K)
        : q(static_cast<const unsigned char*>(values)), scale_min(static_cast<const unsigned*>(s)), K(K) {}
    struct Raw {
        unsigned q;
        unsigned scale_min;
    };
    __device__ __forceinline__ Raw fetch(int row, int k) const {
        return Raw{load_streaming_4(q + (size_t)row * (K / 2) + k / 2), __ldg(scale_min + (size_t)row * (K / 32) + k / 32)};
    }
    __device__ __forceinline__ uint4 expand(const Raw& raw) const {  // weight j: nibble j % 2 of byte j / 2
        return scaled(raw.scale_min, [&](int j) { return (float)((raw.q >> (4 * j)) & 15); });
    }
};
