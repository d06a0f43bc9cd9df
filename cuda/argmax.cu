// Greedy picks: the index of each row's largest logit, ties to the lowest index (NumPy's argmax,
// NaN counting as largest); twin: x.argmax(axis=1) in cupyspec/sampling/argmax.py. One block per
// row (cuda/argmax.cuh). `argmax_logprob_rows` also gives the pick's log-softmax, -log(sum(exp(x -
// max))), in the same pass over the row.

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

extern "C" __global__ void __launch_bounds__(THREADS) argmax_logprob_rows(
    const float* __restrict__ x,     // [R, V]
    long long vocab,
    long long* __restrict__ out,     // [R]
    float* __restrict__ logprob)     // [R]: log-softmax of the pick
{
    release_dependent_grid();
    wait_for_prior_grid();
    float sum;
    const long long index = block_scan<true>(x + (long long)blockIdx.x * vocab, vocab, &sum);
    if (threadIdx.x == 0) {
        out[blockIdx.x] = index;
        logprob[blockIdx.x] = -logf(sum);
    }
}
