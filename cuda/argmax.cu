// Greedy picks: the index of each row's largest logit, ties to the lowest index (NumPy's argmax,
// NaN counting as largest); twin: x.argmax(axis=1) in cupyspec/sampling/argmax.py. One block per
// row (cuda/argmax.cuh). `argmax_logprob_rows` also gives the pick's log-softmax, max - log(sum(exp(x
// - max))), from a second pass over the row, which the first left in L2.

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
    __shared__ float sum_s[THREADS];
    release_dependent_grid();
    wait_for_prior_grid();
    const float* row = x + (long long)blockIdx.x * vocab;
    const long long index = block_argmax(row, vocab);
    const float best = row[index];
    float sum = 0.f;
    for (long long i = threadIdx.x; i < vocab; i += blockDim.x) sum += __expf(__ldg(row + i) - best);
    sum_s[threadIdx.x] = sum;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) sum_s[threadIdx.x] += sum_s[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[blockIdx.x] = index;
        logprob[blockIdx.x] = -logf(sum_s[0]);
    }
}
