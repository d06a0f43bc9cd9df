// SwiGLU; twin: silu_mul in cupyspec/model/ops.py.
// out[t, j] = fp16(silu(gate) * up) in fp32, gate = gate_up[t, j], up = gate_up[t, F + j].

#include "decoder.cuh"

extern "C" __global__ void swiglu(
    const half* __restrict__ gate_up,    // [T, 2F]
    half* __restrict__ out,              // [T, F]
    long long num_tokens, int width)     // width = F
{
    release_dependent_grid();
    wait_for_prior_grid();
    const long long index = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= num_tokens * width) return;
    const long long t = index / width;
    const int j = index % width;
    out[index] = __float2half(silu_mul(__half2float(gate_up[t * 2 * width + j]),
                                       __half2float(gate_up[t * 2 * width + width + j])));
}
