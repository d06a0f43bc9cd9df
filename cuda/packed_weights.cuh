// Weight matrices w [N, K] as the gemv kernels read them: fp16, or packed for weight-only
// quantization (twin: cupyspec/model/quantized.py). Packed matrices hold groups of 32 weights along K,
// K % 32 == 0, each with an fp16 scale and minimum (s, m):  w = fp16(s q + m), rounded once
//
//   wint8: q [N, K] int8 (in [-127, 127] with m = 0, or in [0, 31]), a word of 8 weights in 8 bytes
//   wint4: q [N, K/2] uint8 in [0, 15], a word of 8 weights in 4 bytes: weight 2 i in bits 4 i .. 4 i + 3
//          and weight 2 i + 1 in bits 16 + 4 i .. 16 + 4 i + 3 (i < 4), so that a pair is one shift
//          and mask away from the halves of a half2
//   (s, m) [N, K4, 2] fp16, K4 = K/32 rounded up to a multiple of 4 (16-byte aligned rows)
//
// The weights are made two at a time on fp16 pairs (fma.rn.f16x2), not through fp32 conversions: the
// GGUF blocks of these levels (Q8_0, Q5_0, Q5_1, Q4_0 and Q4_1; s may be negative) come back as the
// fp16 values a GGUF file of them loads as.
//
// The gemv reads a row in rounds of GEMV_WARPS * GEMV_UNROLL slices of 32 k: in a round, warp w takes
// slices w + GEMV_WARPS u (u < GEMV_UNROLL), and the lane of quad j the word at k = 8 j of each. A
// packed row keeps each whole round in that order, so that one load brings a lane all its weights: the
// word of lane (w, j) of slice u at position (4 w + j) GEMV_UNROLL + u of the round, the (s, m) of warp
// w's slice u at w GEMV_UNROLL + u. The rest of the row, less than a round, stays in k order.
//
// A source gives a lane's weights of one row and round in two steps, so that its loads stay in flight
// meanwhile: fetch(row, first, quad) issues them for slices first + GEMV_WARPS u (a Raw value; Raw{}
// reads as zeros, as do slices past K), expand(raw, u) makes slice u's 8 packed halves, the lower k in
// the lower half of each word.

#pragma once

#include <cuda_fp16.h>

#define GEMV_WARPS 12     // warps per gemv block, splitting K: one round of loads for K <= 1536
#define GEMV_UNROLL 4     // 32-wide K slices per warp with loads in flight
#define ROUND (GEMV_WARPS * GEMV_UNROLL)  // slices of a round

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

__device__ __forceinline__ unsigned load_streaming_4(const void* pointer) {
    unsigned v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(pointer));
    return v;
}

struct HalfWeights {  // w [N, K] fp16, K % 8 == 0 (the scales argument is unused)
    const half* w;
    int K;
    __device__ HalfWeights(const void* values, const void*, int K) : w(static_cast<const half*>(values)), K(K) {}
    struct Raw {
        uint4 slice[GEMV_UNROLL];
    };
    __device__ __forceinline__ Raw fetch(int row, int first, int quad) const {
        Raw raw{};
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int k = (first + u * GEMV_WARPS) * 32 + 8 * quad;
            if (k < K) raw.slice[u] = load_streaming(w + (size_t)row * K + k);
        }
        return raw;
    }
    __device__ __forceinline__ uint4 expand(const Raw& raw, int u) const { return raw.slice[u]; }
};

__device__ __forceinline__ size_t scale_row(int row, int K) { return (size_t)row * ((K / 32 + 3) / 4 * 4); }

__device__ __forceinline__ unsigned component(uint4 v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

// The packed words (WORD bytes each: 8 weights) and (s, m) of a lane's slices first + GEMV_WARPS u of
// one row (q and scale_min point at the row's): a whole round's words in 16-byte loads, the rest's
// one by one in k order.
template <int WORD>
struct PackedLane {
    static_assert(GEMV_UNROLL == 4, "a lane's words fill 16-byte loads");
    uint4 words[WORD / 4];  // 32-bit word i of slice u: word u WORD / 4 + i
    uint4 scale_min;        // slice u's: component u

    __device__ __forceinline__ void fetch(const unsigned char* q, const unsigned* scale_min_row, int K, int first,
                                          int quad) {
        const int slices = K / 32, round = first - first % GEMV_WARPS, warp = first - round;
        if (round + ROUND <= slices) {
            const unsigned char* at = q + ((size_t)round * 4 + (4 * warp + quad) * GEMV_UNROLL) * WORD;
#pragma unroll
            for (int i = 0; i < WORD / 4; ++i) words[i] = load_streaming(at + 16 * i);
            scale_min = __ldg(reinterpret_cast<const uint4*>(scale_min_row + round + warp * GEMV_UNROLL));
            return;
        }
        unsigned* w = reinterpret_cast<unsigned*>(words);
        unsigned* s = reinterpret_cast<unsigned*>(&scale_min);
#pragma unroll
        for (int u = 0; u < GEMV_UNROLL; ++u) {
            const int slice = first + u * GEMV_WARPS;
            s[u] = slice < slices ? __ldg(scale_min_row + slice) : 0u;
#pragma unroll
            for (int i = 0; i < WORD / 4; ++i)
                w[u * WORD / 4 + i] = slice < slices ? load_streaming_4(q + ((size_t)slice * 4 + quad) * WORD + 4 * i) : 0u;
        }
    }
    __device__ __forceinline__ unsigned word(int u, int i) const {
        return component(words[(u * WORD / 4 + i) / 4], (u * WORD / 4 + i) % 4);
    }
};

// d = a b + c on both halves of fp16 pairs, rounded once; d = a - b likewise
__device__ __forceinline__ unsigned fma_f16x2(unsigned a, unsigned b, unsigned c) {
    unsigned d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ unsigned sub_f16x2(unsigned a, unsigned b) {
    unsigned d;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// The 8 weights fp16(s q_j + m) of a group's (s, m) (s in the low half), packed as halves. pair(i)
// gives weights 2 i and 2 i + 1 in the low and high half as the bits 0x6400 + c, the fp16 number
// 1024 + c (fp16's step is 1 there), with c = q + BIAS - 0x6400: subtracting the fp16 number of bits
// BIAS leaves q exactly.
template <unsigned BIAS, typename Pair>
__device__ __forceinline__ uint4 scaled(unsigned scale_min, Pair pair) {
    const unsigned s = __byte_perm(scale_min, 0, 0x1010), m = __byte_perm(scale_min, 0, 0x3232);
    const unsigned bias = BIAS | BIAS << 16;
    return uint4{fma_f16x2(sub_f16x2(pair(0), bias), s, m), fma_f16x2(sub_f16x2(pair(1), bias), s, m),
                 fma_f16x2(sub_f16x2(pair(2), bias), s, m), fma_f16x2(sub_f16x2(pair(3), bias), s, m)};
}

// wint8 (BITS 8): q [N, K] int8; wint4 (BITS 4): q [N, K/2] uint8. A word of 8 weights is BITS bytes.
template <int BITS>
struct PackedWeights {
    static_assert(BITS == 8 || BITS == 4, "wint8 or wint4");
    const unsigned char* q;     // [N, K * BITS / 8]
    const unsigned* scale_min;  // [N, K4] pairs of fp16 (s, m), s in the low half
    int K;
    __device__ PackedWeights(const void* values, const void* s, int K)
        : q(static_cast<const unsigned char*>(values)), scale_min(static_cast<const unsigned*>(s)), K(K) {}
    using Raw = PackedLane<BITS>;
    __device__ __forceinline__ Raw fetch(int row, int first, int quad) const {
        Raw raw;
        raw.fetch(q + (size_t)row * (K / (8 / BITS)), scale_min + scale_row(row, K), K, first, quad);
        return raw;
    }
    // wint8: weight j is byte j % 4 of word j / 4, signed: q + 128 goes under 0x64 (fp16 1152 + q);
    // wint4: a word's nibbles under 0x640 (fp16 1024 + q), as the layout pairs them
    __device__ __forceinline__ uint4 expand(const Raw& raw, int u) const {
        const unsigned scale_min = component(raw.scale_min, u);
        if constexpr (BITS == 8) {
            const unsigned lo = raw.word(u, 0) ^ 0x80808080u, hi = raw.word(u, 1) ^ 0x80808080u;
            return scaled<0x6480>(scale_min, [&](int i) {
                return __byte_perm(i < 2 ? lo : hi, 0x64646464u, (i & 1) ? 0x4342 : 0x4140);
            });
        } else {
            const unsigned word = raw.word(u, 0);
            return scaled<0x6400>(scale_min, [&](int i) { return ((word >> (4 * i)) & 0x000f000fu) | 0x64006400u; });
        }
    }
};
using Int8Weights = PackedWeights<8>;
using Int4Weights = PackedWeights<4>;
