// Greedy picks: the index of each row's largest logit, ties to the lowest index (NumPy's argmax,
// NaN counting as largest); twin: x.argmax(axis=1) in cupyspec/sampling/argmax.py.
//
// One block per row. Thread t scans columns t, t + THREADS, ... in increasing order, keeping the
// first best; the threads' bests then meet in a tree that prefers the lower index on ties, so the
// pick is NumPy's whatever the order of the merges.

#include "grid_dependency.cuh"

#define THREADS 512

struct Best {
    float value;
    long long index;
};

__device__ __forceinline__ bool beats(float v, long long i, const Best& b) {
    const bool v_nan = v != v, b_nan = b.value != b.value;
    if (v_nan || b_nan) return v_nan && (!b_nan || i < b.index);
    return v > b.value || (v == b.value && i < b.index);
}

extern "C" __global__ void __launch_bounds__(THREADS) argmax_rows(
    const float* __restrict__ x,     // [R, V]
    long long vocab,
    long long* __restrict__ out)     // [R]
{
    release_dependent_grid();
    wait_for_prior_grid();
    __shared__ Best best_s[THREADS];
    const float* row = x + (long long)blockIdx.x * vocab;
    Best best{row[0], 0};
    for (long long i = threadIdx.x; i < vocab; i += THREADS) {
        const float v = __ldg(row + i);
        if (beats(v, i, best)) best = Best{v, i};
    }
    best_s[threadIdx.x] = best;
    __syncthreads();
    for (int stride = THREADS / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) {
            const Best other = best_s[threadIdx.x + stride];
            if (beats(other.value, other.index, best_s[threadIdx.x])) best_s[threadIdx.x] = other;
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_s[0].index;
}
