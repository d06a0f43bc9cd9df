// Greedy picks: the index of each row's largest logit, ties to the lowest index (NumPy's argmax,
// NaN counting as largest); twin: x.argmax(axis=1) in cupyspec/sampling/argmax.py. One block per
// row (cuda/argmax.cuh).

#include "argmax.cuh"
#include "grid_dependency.cuh"

#define THREADS 512

extern "C" __global__ void __launch_bounds__(THREADS) argmax_rows(
    const float* __restrict__ x,     // [R, V]
    long long vocab,
    long long* __restrict__ out)     // [R]
{
    release_dependent_grid();
    wait_for_prior_grid();
    const long long index = block_argmax(x + (long long)blockIdx.x * vocab, vocab);
    if (threadIdx.x == 0) out[blockIdx.x] = index;
}
