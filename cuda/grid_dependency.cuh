// Programmatic dependent launch (sm_90 and later). A kernel launched with it (cupyspec/kernels.py,
// inside CUDA-graph capture) may start while the kernel before it in the stream still runs:
// everything before wait_for_prior_grid() must touch only memory that no earlier kernel writes
// (weights), and everything after it sees that kernel finished. release_dependent_grid() lets the
// next kernel start launching. Launched without the attribute, both do nothing.
#pragma once

__device__ __forceinline__ void wait_for_prior_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void release_dependent_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
