// One block's scan of a row: the argmax, ties to the lowest index (NumPy's argmax, NaN counting as
// largest), and optionally sum(exp(x - max)) for the pick's log-softmax; used by cuda/argmax.cu and
// cuda/accept_runs.cu.
//
// Thread t scans its columns in increasing order, keeping the first best and, with the sum, the
// running sum of exp(x - its best so far), rescaled when the best rises (online softmax). It reads
// float4s, ARGMAX_UNROLL of them in flight, where the row allows (16-byte aligned, vocab % 4 == 0):
// a row is one block's, and one load at a time would leave the block waiting on memory latency. The
// threads' states then meet in a tree that prefers the lower index on ties, so the pick is NumPy's
// whatever the order of the merges.
#pragma once

#define ARGMAX_MAX_THREADS 512
#define ARGMAX_UNROLL 4
#define ARGMAX_NEG_INF __int_as_float(0xff800000)

struct Best {
    float value;
    long long index;
};

__device__ __forceinline__ bool beats(float v, long long i, const Best& b) {
    const bool v_nan = v != v, b_nan = b.value != b.value;
    if (v_nan || b_nan) return v_nan && (!b_nan || i < b.index);
    return v > b.value || (v == b.value && i < b.index);
}

// sum * exp(from - to): a sum of exp(x - from) moved to exp(x - to) (an empty sum stays 0).
__device__ __forceinline__ float rescaled(float sum, float from, float to) {
    return sum == 0.f ? 0.f : sum * __expf(from - to);
}

// Merge another scan's state (other, other_sum) into (best, sum): the better pick, the sums moved to it.
__device__ __forceinline__ void merge_scans(Best& best, float& sum, const Best& other, float other_sum) {
    const Best merged = beats(other.value, other.index, best) ? other : best;
    sum = rescaled(sum, best.value, merged.value) + rescaled(other_sum, other.value, merged.value);
    best = merged;
}

template <bool WITH_SUM>
__device__ __forceinline__ void scan_value(float v, long long i, Best& best, float& sum) {
    if (beats(v, i, best)) {
        if (WITH_SUM) sum = rescaled(sum, best.value, v) + (v == ARGMAX_NEG_INF ? 0.f : 1.f);
        best = Best{v, i};
    } else if (WITH_SUM && v != ARGMAX_NEG_INF) {  // (exp(-inf - best) is 0; skipped, it is NaN where best is -inf)
        sum += __expf(v - best.value);
    }
}

// The column of row [vocab]'s largest value, for every thread of the block (blockDim.x a power of
// two, at most ARGMAX_MAX_THREADS); with WITH_SUM, *sum_out gets sum(exp(row - row[column])).
template <bool WITH_SUM>
__device__ __forceinline__ long long block_scan(const float* __restrict__ row, long long vocab, float* sum_out) {
    __shared__ Best best_s[ARGMAX_MAX_THREADS];
    __shared__ float sum_s[ARGMAX_MAX_THREADS];
    Best best{ARGMAX_NEG_INF, vocab};  // beaten by any column (ties to the lower index)
    float sum = 0.f;
    const bool vectors = vocab % 4 == 0 && reinterpret_cast<unsigned long long>(row) % 16 == 0;
    const long long num_vectors = vectors ? vocab / 4 : 0;
    const float4* row4 = reinterpret_cast<const float4*>(row);
    for (long long j = threadIdx.x; j < num_vectors; j += (long long)blockDim.x * ARGMAX_UNROLL) {
        float4 v[ARGMAX_UNROLL];
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; ++u) {
            const long long at = j + (long long)u * blockDim.x;
            if (at < num_vectors) v[u] = __ldg(row4 + at);
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_UNROLL; ++u) {
            const long long at = j + (long long)u * blockDim.x;
            if (at < num_vectors) {
                scan_value<WITH_SUM>(v[u].x, 4 * at, best, sum);
                scan_value<WITH_SUM>(v[u].y, 4 * at + 1, best, sum);
                scan_value<WITH_SUM>(v[u].z, 4 * at + 2, best, sum);
                scan_value<WITH_SUM>(v[u].w, 4 * at + 3, best, sum);
            }
        }
    }
    for (long long i = 4 * num_vectors + threadIdx.x; i < vocab; i += blockDim.x)
        scan_value<WITH_SUM>(__ldg(row + i), i, best, sum);
    best_s[threadIdx.x] = best;
    if (WITH_SUM) sum_s[threadIdx.x] = sum;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) {
            const Best other = best_s[threadIdx.x + stride];
            if (WITH_SUM) {
                merge_scans(best_s[threadIdx.x], sum_s[threadIdx.x], other, sum_s[threadIdx.x + stride]);
            } else if (beats(other.value, other.index, best_s[threadIdx.x])) {
                best_s[threadIdx.x] = other;
            }
        }
        __syncthreads();
    }
    const long long index = best_s[0].index;
    if (WITH_SUM) *sum_out = sum_s[0];
    __syncthreads();  // the shared arrays may be reused
    return index;
}

__device__ __forceinline__ long long block_argmax(const float* __restrict__ row, long long vocab) {
    return block_scan<false>(row, vocab, nullptr);
}
