// One block's argmax of a row, ties to the lowest index (NumPy's argmax, NaN counting as largest);
// used by cuda/argmax.cu and cuda/accept_runs.cu.
//
// Thread t scans columns t, t + blockDim.x, ... in increasing order, keeping the first best; the
// threads' bests then meet in a tree that prefers the lower index on ties, so the pick is NumPy's
// whatever the order of the merges.
#pragma once

#define ARGMAX_MAX_THREADS 512

struct Best {
    float value;
    long long index;
};

__device__ __forceinline__ bool beats(float v, long long i, const Best& b) {
    const bool v_nan = v != v, b_nan = b.value != b.value;
    if (v_nan || b_nan) return v_nan && (!b_nan || i < b.index);
    return v > b.value || (v == b.value && i < b.index);
}

// The column of row [vocab]'s largest value, for every thread of the block (blockDim.x a power of
// two, at most ARGMAX_MAX_THREADS).
__device__ __forceinline__ long long block_argmax(const float* __restrict__ row, long long vocab) {
    __shared__ Best best_s[ARGMAX_MAX_THREADS];
    Best best{row[0], 0};
    for (long long i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = __ldg(row + i);
        if (beats(v, i, best)) best = Best{v, i};
    }
    best_s[threadIdx.x] = best;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) {
            const Best other = best_s[threadIdx.x + stride];
            if (beats(other.value, other.index, best_s[threadIdx.x])) best_s[threadIdx.x] = other;
        }
        __syncthreads();
    }
    const long long index = best_s[0].index;
    __syncthreads();  // best_s may be reused
    return index;
}
