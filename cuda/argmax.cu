// Greedy picks: the index of each row's largest logit, ties to the lowest index (NumPy's argmax,
// NaN counting as largest); twin: x.argmax(axis=1) in cupyspec/sampling/argmax.py. One block per
// row (cuda/argmax.cuh). `argmax_logprob_rows` also gives the pick's log-softmax, -log(sum(exp(x -
// max))), in the same pass over the row. Where a few rows would leave most SMs idle (an MTP head's
// drafts), `argmax_logprob_partials` scans column chunks of each row in blocks of their own and
// `argmax_logprob_combine` merges the chunks' states as the block's threads do.

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

extern "C" __global__ void __launch_bounds__(THREADS) argmax_logprob_partials(
    const float* __restrict__ x,         // [R, V]
    long long vocab,
    long long chunk,                     // columns per block (a multiple of 4)
    float* __restrict__ part_value,      // [R, C]: each chunk's largest value
    long long* __restrict__ part_index,  // [R, C]: its column
    float* __restrict__ part_sum)        // [R, C]: sum(exp(x - that value)) over the chunk
{
    release_dependent_grid();
    wait_for_prior_grid();
    const long long start = (long long)blockIdx.x * chunk;
    const float* row = x + (long long)blockIdx.y * vocab;
    float sum;
    const long long index = start + block_scan<true>(row + start, min(chunk, vocab - start), &sum);
    if (threadIdx.x == 0) {
        const long long slot = (long long)blockIdx.y * gridDim.x + blockIdx.x;
        part_value[slot] = row[index];
        part_index[slot] = index;
        part_sum[slot] = sum;
    }
}

extern "C" __global__ void argmax_logprob_combine(
    const float* __restrict__ part_value,      // [R, C]
    const long long* __restrict__ part_index,  // [R, C]
    const float* __restrict__ part_sum,        // [R, C]
    int chunks,                                // C
    long long* __restrict__ out,               // [R]
    float* __restrict__ logprob)               // [R]
{
    release_dependent_grid();
    wait_for_prior_grid();
    if (threadIdx.x != 0) return;
    const long long base = (long long)blockIdx.x * chunks;
    Best best{part_value[base], part_index[base]};
    float sum = part_sum[base];
    for (int c = 1; c < chunks; ++c)  // in column order: ties keep the earlier chunk's pick
        merge_scans(best, sum, Best{part_value[base + c], part_index[base + c]}, part_sum[base + c]);
    out[blockIdx.x] = best.index;
    logprob[blockIdx.x] = -logf(sum);
}
