// Row log-softmax normalizers and top-k; twin: top_logprobs_on_device in cupyspec/logprobs/logsoftmax_topk.py.
//
// One block per selected row r of logits [R, V] (rows[r] picks it; row r itself when rows is null; a
// negative rows[r] picks none, and row r's outputs are left as they are: a padding row). Outputs
//   peak[r] = max_t x[t], log_total[r] = log sum_t exp(x[t] - peak) (f64 sum),
//   the k largest entries, largest first, ties broken by the lower index, and their logprobs
//   f32(f64(x[t] - peak) - log_total); when chosen_ids is given, the logprob of chosen_ids[r] too.
// Top-k: a first pass finds each thread's best over a strided slice of the row; the k-th best of
// those bounds the row's k best from below. A second pass, which sums the exponentials, has each
// thread keep a sorted list of its CAP best entries among those at least as good as the bound (CAP
// >= k, a compile-time size, so that the list stays in registers: a list indexed at run time goes
// to local memory, which is many times slower), then k rounds of a block-wide arg-max over the
// threads' list heads pick the winners in order.
// A row is one block's work however few rows there are (a single row at batch 1), so the scans
// keep UNROLL independent loads in flight per thread: with one load at a time, a row's cost is
// bound by the latency of global memory.

#define THREADS 1024
#define UNROLL 8
#define NEG_INF __int_as_float(0xff800000)

struct Best {
    float value;
    int index;  // INT_MAX: empty
};

__device__ __forceinline__ bool better(Best a, Best b) {  // larger value first, then lower index
    return a.value > b.value || (a.value == b.value && a.index < b.index);
}

__device__ Best block_best(Best mine, Best* scratch) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        Best other{__shfl_down_sync(0xffffffff, mine.value, offset), __shfl_down_sync(0xffffffff, mine.index, offset)};
        if (better(other, mine)) mine = other;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = mine;
    __syncthreads();
    if (warp == 0) {
        mine = lane < THREADS / 32 ? scratch[lane] : Best{NEG_INF, 0x7fffffff};
        for (int offset = 16; offset > 0; offset >>= 1) {
            Best other{__shfl_down_sync(0xffffffff, mine.value, offset), __shfl_down_sync(0xffffffff, mine.index, offset)};
            if (better(other, mine)) mine = other;
        }
        if (lane == 0) scratch[0] = mine;
    }
    __syncthreads();
    const Best result = scratch[0];
    __syncthreads();
    return result;
}

__device__ double block_sum(double mine, double* scratch) {
    for (int offset = 16; offset > 0; offset >>= 1) mine += __shfl_down_sync(0xffffffff, mine, offset);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = mine;
    __syncthreads();
    if (warp == 0) {
        mine = lane < THREADS / 32 ? scratch[lane] : 0.0;
        for (int offset = 16; offset > 0; offset >>= 1) mine += __shfl_down_sync(0xffffffff, mine, offset);
        if (lane == 0) scratch[0] = mine;
    }
    __syncthreads();
    const double result = scratch[0];
    __syncthreads();
    return result;
}

template <int CAP>
__device__ __forceinline__ void logsoftmax_topk(
    const float* __restrict__ logits, long long vocab, const long long* __restrict__ rows, int k,
    const long long* __restrict__ chosen_ids, float* __restrict__ chosen_lps, float* __restrict__ peak,
    double* __restrict__ log_total, long long* __restrict__ top_ids, float* __restrict__ top_lps)
{
    __shared__ Best best_scratch[THREADS / 32];
    __shared__ double sum_scratch[THREADS / 32];
    const int r = blockIdx.x;
    const long long row = rows != nullptr ? rows[r] : r;
    if (row < 0) return;  // the whole block: no barrier is waited for
    const float* x = logits + row * vocab;
    const Best empty{NEG_INF, 0x7fffffff};

    // ---- pass 1: this thread's best; the row's peak, and the k-th best of the threads' bests ----
    Best top = empty;
    for (long long base = threadIdx.x; base < vocab; base += UNROLL * THREADS) {
        float v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {  // loads first, all in flight together
            const long long t = base + u * THREADS;
            v[u] = t < vocab ? x[t] : NEG_INF;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long t = base + u * THREADS;
            if (t >= vocab) break;
            const Best candidate{v[u], (int)t};
            if (better(candidate, top)) top = candidate;
        }
    }
    // k distinct entries are at least as good as the k-th best of the threads' bests, so each of the
    // row's k best is too: pass 2 lists only those (a handful), not every entry that beats a
    // thread's own CAP-th best (at 48 entries a thread, some 22 insertions of CAP steps each).
    Best left = top, bound = empty;  // this thread's best until a round picks it
    float row_peak = NEG_INF;
    for (int c = 0; c < max(k, 1); ++c) {
        bound = block_best(left, best_scratch);
        if (c == 0) row_peak = bound.value;
        if (left.index == bound.index) left = empty;
    }

    // ---- pass 2: log sum exp, and this thread's CAP best of the entries at least as good as the bound ----
    Best list[CAP];
#pragma unroll
    for (int c = 0; c < CAP; ++c) list[c] = empty;
    double sum = 0.0;
    for (long long base = threadIdx.x; base < vocab; base += UNROLL * THREADS) {
        float v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long t = base + u * THREADS;
            v[u] = t < vocab ? x[t] : NEG_INF;  // exp(-inf) adds 0
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) sum += (double)expf(v[u] - row_peak);
        if (k == 0) continue;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const long long t = base + u * THREADS;
            const Best candidate{v[u], (int)t};
            if (t >= vocab || better(bound, candidate) || !better(candidate, list[CAP - 1])) continue;
            list[CAP - 1] = candidate;  // replace the last, then bubble it up
#pragma unroll
            for (int c = CAP - 1; c > 0; --c) {
                if (better(list[c], list[c - 1])) {
                    const Best swap = list[c];
                    list[c] = list[c - 1];
                    list[c - 1] = swap;
                }
            }
        }
    }
    const double row_log_total = log(block_sum(sum, sum_scratch));
    if (threadIdx.x == 0) {
        if (peak != nullptr) peak[r] = row_peak;
        if (log_total != nullptr) log_total[r] = row_log_total;
        if (chosen_ids != nullptr) chosen_lps[r] = (float)((double)(x[chosen_ids[r]] - row_peak) - row_log_total);
    }

    // ---- k rounds of arg-max over the list heads ----
    int head = 0;
    for (int c = 0; c < k; ++c) {
        Best mine = empty;
#pragma unroll
        for (int j = 0; j < CAP; ++j) {  // list[head], by compile-time indices
            if (j == head) mine = list[j];
        }
        const Best winner = block_best(mine, best_scratch);
        if (head < CAP && mine.index == winner.index) ++head;
        if (threadIdx.x == 0) {
            top_ids[(long long)r * k + c] = winner.index;
            top_lps[(long long)r * k + c] = (float)((double)(winner.value - row_peak) - row_log_total);
        }
    }
}

#define LOGSOFTMAX_TOPK(NAME, CAP)                                                                        \
    extern "C" __global__ void __launch_bounds__(THREADS) NAME(                                           \
        const float* __restrict__ logits, long long vocab,   /* [R_all, V] */                             \
        const long long* __restrict__ rows,                 /* [R] rows of logits to process, or null */  \
        int k,                                              /* 0..CAP */                                  \
        const long long* __restrict__ chosen_ids,           /* [R] tokens whose logprobs are wanted, or null */ \
        float* __restrict__ chosen_lps,                     /* [R] their logprobs */                      \
        float* __restrict__ peak,                           /* [R], or null: not wanted */                \
        double* __restrict__ log_total,                     /* [R], or null: not wanted */                \
        long long* __restrict__ top_ids,                    /* [R, k] */                                  \
        float* __restrict__ top_lps)                        /* [R, k] */                                  \
    {                                                                                                     \
        logsoftmax_topk<CAP>(logits, vocab, rows, k, chosen_ids, chosen_lps, peak, log_total, top_ids,    \
                             top_lps);                                                                    \
    }

LOGSOFTMAX_TOPK(logsoftmax_top8, 8)
LOGSOFTMAX_TOPK(logsoftmax_top20, 20)
