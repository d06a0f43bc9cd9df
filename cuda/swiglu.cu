// SwiGLU; twin: silu_mul in cupyspec/model/ops.py.
// out[t, j] = fp16(silu(gate) * up) in fp32, gate = gate_up[t, j], up = gate_up[t, F + j].

#include <cuda_fp16.h>

extern "C" __global__ void swiglu(
    const half* __restrict__ gate_up,    // [T, 2F]
    half* __restrict__ out,              // [T, F]
    long long num_tokens, int width)     // width = F
{
    const long long index = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (index >= num_tokens * width) return;
    const long long t = index / width;
    const int j = index % width;
    const float gate = __half2float(gate_up[t * 2 * width + j]), up = __half2float(gate_up[t * 2 * width + width + j]);
    out[index] = __float2half(__fmul_rn(__fdiv_rn(gate, __fadd_rn(1.0f, expf(-gate))), up));
}
