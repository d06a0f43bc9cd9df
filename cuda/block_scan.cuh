// A prefix sum over the threads of one block, for kernels that place each thread's chunk of work.

#pragma once

// Stores in partial[t] (shared memory, one element per thread) the sum of `value` over threads
// 0..t, for every thread t of the block, and returns it. Every thread of the block calls it.
__device__ __forceinline__ long long block_inclusive_scan(long long* partial, long long value) {
    const int t = threadIdx.x;
    partial[t] = value;
    __syncthreads();
    for (int stride = 1; stride < (int)blockDim.x; stride <<= 1) {
        const long long add = t >= stride ? partial[t - stride] : 0;
        __syncthreads();
        partial[t] += add;
        __syncthreads();
    }
    return partial[t];
}
