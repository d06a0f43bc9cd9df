// Positions of a step formed before the host knew how many drafts the step before accepted; twin:
// cupyspec/model/positions.py.
//
// Row t of a sequence whose earlier step's verdict was still on the device carries shift_from[t] =
// that sequence's index s in the earlier step (else -1): its position moves on by accepted[s], and
// its KV slot follows from the block table.

#include "grid_dependency.cuh"

extern "C" __global__ void shift_positions(
    int* __restrict__ positions,          // [T], updated
    int* __restrict__ slots,              // [T], updated
    const int* __restrict__ batch_ids,    // [T]
    const int* __restrict__ tables,       // [B, width]
    int width,
    const int* __restrict__ shift_from,   // [T] sequence index in the earlier step, or -1
    const int* __restrict__ accepted,     // [S] drafts the earlier step accepted per sequence
    int block_size,
    int rows) {
    release_dependent_grid();
    wait_for_prior_grid();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows) return;
    const int s = shift_from[t];
    if (s < 0) return;
    const int position = positions[t] + accepted[s];
    positions[t] = position;
    slots[t] = tables[batch_ids[t] * width + position / block_size] * block_size + position % block_size;
}
