// Token embedding with placeholder ids; twin: cupyspec/model/embedding.py.
//
// Under overlap scheduling a sequence's next input token may still be on the device, sampled by
// the step before: its input id is then the placeholder ~s (= -s - 1), and the token is previous[s].
// One block per token row copies its fp16 embedding row into the fp32 residual stream.

#include <cuda_fp16.h>

#include "grid_dependency.cuh"

extern "C" __global__ void embed_tokens(
    const half* __restrict__ table,     // [V, H] embedding
    const int* __restrict__ ids,        // [T] token ids, or ~s for previous[s]
    const int* __restrict__ previous,   // [S] tokens sampled by the previous step
    float* __restrict__ out,            // [T, H] fp32
    int hidden) {
    release_dependent_grid();
    wait_for_prior_grid();
    const int row = blockIdx.x;
    int id = ids[row];
    if (id < 0) id = previous[~id];
    const half2* src = reinterpret_cast<const half2*>(table + (size_t)id * hidden);
    float2* dst = reinterpret_cast<float2*>(out + (size_t)row * hidden);
    for (int i = threadIdx.x; i < hidden / 2; i += blockDim.x) dst[i] = __half22float2(src[i]);
}
