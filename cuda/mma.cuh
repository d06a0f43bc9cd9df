// One tensor-core product, mma.m16n8k16 (sm_80 and later): d += a b for a 16x16 fp16 A (row-major),
// a 16x8 fp16 B (column-major) and a 16x8 fp32 D. With g = lane / 4 and c = lane % 4, a lane holds
// a0 = A[g][2c..2c+1], a1 = A[g+8][2c..2c+1], a2 = A[g][2c+8..2c+9], a3 = A[g+8][2c+8..2c+9] (two
// halves a word, the lower index in the low half); b0 = B[2c..2c+1][g], b1 = B[2c+8..2c+9][g]; and
// d = D[g][2c], D[g][2c+1], D[g+8][2c], D[g+8][2c+1].
#pragma once

__device__ __forceinline__ void mma_16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
