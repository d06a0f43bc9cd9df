// Logprobs as OpenAI chat `logprobs.content` JSON entries, written by blocks of threads; twin:
// cupyspec/logprobs/logprob_json.py. Used by cuda/logprob_json.cu, for a plain step's rows and for
// a verified step's emitted tokens once cuda/accept_gather.cu has gathered them.
//
// Row r (an emitted token) of request b becomes, with the request's first k[b] alternatives,
//   {"token":T,"logprob":X,"bytes":B,"top_logprobs":[{"token":T1,"logprob":X1,"bytes":B1},...]},
// T and B copied from the vocabulary table, X formatted here. k[b] < 0: the row stays empty. The
// entry is cut in slots, one per token (`put_slot`). Each thread of a block measures a chunk of
// slots, a block scan of the chunk sizes places them, and the threads write the slots of their
// block's share where they go; ends[r] is where row r's entry (and comma) ends. Bytes past the
// capacity are dropped: the host sees it from ends and renders those rows itself.

#pragma once

#include "block_scan.cuh"

#define RENDER_MAX_THREADS 1024
#define MIN_LOGPROB -9999.0
#define DIGITS 9

// 10^e for e in [-46, 4], and 10^(8 - e) for the same e: C literals, as the twin's float("1e<e>")
__constant__ double POW10[51] = {
    1e-46, 1e-45, 1e-44, 1e-43, 1e-42, 1e-41, 1e-40, 1e-39, 1e-38, 1e-37, 1e-36, 1e-35, 1e-34, 1e-33,
    1e-32, 1e-31, 1e-30, 1e-29, 1e-28, 1e-27, 1e-26, 1e-25, 1e-24, 1e-23, 1e-22, 1e-21, 1e-20, 1e-19,
    1e-18, 1e-17, 1e-16, 1e-15, 1e-14, 1e-13, 1e-12, 1e-11, 1e-10, 1e-9, 1e-8, 1e-7, 1e-6, 1e-5,
    1e-4, 1e-3, 1e-2, 1e-1, 1e0, 1e1, 1e2, 1e3, 1e4};
__constant__ double SCALE[51] = {
    1e54, 1e53, 1e52, 1e51, 1e50, 1e49, 1e48, 1e47, 1e46, 1e45, 1e44, 1e43, 1e42, 1e41, 1e40, 1e39,
    1e38, 1e37, 1e36, 1e35, 1e34, 1e33, 1e32, 1e31, 1e30, 1e29, 1e28, 1e27, 1e26, 1e25, 1e24, 1e23,
    1e22, 1e21, 1e20, 1e19, 1e18, 1e17, 1e16, 1e15, 1e14, 1e13, 1e12, 1e11, 1e10, 1e9, 1e8, 1e7,
    1e6, 1e5, 1e4};

// Where the entries go: bytes from out[0] up to capacity (out null: measure only).
struct Output {
    unsigned char* out;
    long long capacity;
};

// Writes n bytes at out[at] (those that fit); returns the position after them.
__device__ __forceinline__ long long put(Output o, long long at, const char* s, int n) {
    if (o.out) for (int i = 0; i < n && at + i < o.capacity; ++i) o.out[at + i] = (unsigned char)s[i];
    return at + n;
}

__device__ __forceinline__ long long put_bytes(Output o, long long at, const unsigned char* s, long long n) {
    if (o.out) for (long long i = 0; i < n && at + i < o.capacity; ++i) o.out[at + i] = s[i];
    return at + n;
}

// A logprob in at most 16 characters: 9 significant digits, trailing zeros dropped; positional
// from 1e-4 up, else d.ddde-XX; at or below MIN_LOGPROB (and NaN) the floor.
__device__ int format_logprob(float value, char* s) {
    double a = (double)value;
    if (!(a > MIN_LOGPROB)) {
        const char floor_text[] = "-9999.0";
        for (int i = 0; i < 7; ++i) s[i] = floor_text[i];
        return 7;
    }
    if (a == 0.0) { s[0] = '0'; s[1] = '.'; s[2] = '0'; return 3; }
    int n = 0;
    if (a < 0.0) { s[n++] = '-'; a = -a; }
    int e = (int)floor(log10(a));  // then exactly: the largest e with POW10[e] <= a
    e = max(-46, min(4, e));
    while (e > -46 && POW10[e + 46] > a) --e;
    while (e < 4 && POW10[e + 47] <= a) ++e;
    long long rounded = llrint(a * SCALE[e + 46]);  // DIGITS digits, rounded half to even
    if (rounded >= 1000000000LL) { rounded /= 10; ++e; }
    unsigned int m = (unsigned int)rounded;  // below 10^9: digits by 32-bit arithmetic
    char d[DIGITS];
    for (int i = DIGITS - 1; i >= 0; --i) { d[i] = (char)('0' + m % 10); m /= 10; }
    int digits = DIGITS;
    while (digits > 1 && d[digits - 1] == '0') --digits;
    if (e < -4) {
        s[n++] = d[0];
        if (digits > 1) { s[n++] = '.'; for (int i = 1; i < digits; ++i) s[n++] = d[i]; }
        s[n++] = 'e'; s[n++] = '-';
        s[n++] = (char)('0' + (-e) / 10); s[n++] = (char)('0' + (-e) % 10);
    } else if (e >= 0) {
        for (int i = 0; i <= e; ++i) s[n++] = i < digits ? d[i] : '0';
        s[n++] = '.';
        if (digits > e + 1) { for (int i = e + 1; i < digits; ++i) s[n++] = d[i]; } else { s[n++] = '0'; }
    } else {
        s[n++] = '0'; s[n++] = '.';
        for (int i = 0; i < -e - 1; ++i) s[n++] = '0';
        for (int i = 0; i < digits; ++i) s[n++] = d[i];
    }
    return n;
}

// {"token":T,"logprob":X,"bytes":B   (the caller closes it)
__device__ long long put_entry(Output out, long long at, long long token, float logprob,
                               const unsigned char* blob, const long long* text_at) {
    char number[16];
    at = put(out, at, "{\"token\":", 9);
    at = put_bytes(out, at, blob + text_at[2 * token], text_at[2 * token + 1] - text_at[2 * token]);
    at = put(out, at, ",\"logprob\":", 11);
    at = put(out, at, number, format_logprob(logprob, number));
    at = put(out, at, ",\"bytes\":", 9);
    return put_bytes(out, at, blob + text_at[2 * token + 1], text_at[2 * token + 2] - text_at[2 * token + 1]);
}

// The rows to render and where their entries go.
struct RenderArgs {
    const long long* token_ids;  // [N]
    const float* logprobs;       // [N]
    const long long* top_ids;    // [N, width]
    const float* top_lps;        // [N, width]
    int width;
    const long long* request_k;  // [B] alternatives per request; < 0: no entries
    const long long* cu;         // [B+1] rows of each request; null: row r is request r
    int num_requests, num_rows;  // B, N
    const unsigned char* blob;   // vocabulary table (VocabJSON)
    const long long* text_at;    // [2V+1]
    unsigned char* out;          // [capacity]
    long long capacity;
    long long* ends;             // [N]
};

// Slot j (0..width) of row r, at out[at]: its token's part of the row's entry, empty past the
// request's k (and every slot of a row whose request wants none); returns the position after it.
//   j = 0:        {"token":T,"logprob":X,"bytes":B,"top_logprobs":[
//   1 <= j <= k:  {"token":Tj,"logprob":Xj,"bytes":Bj}   then "," before the next, "]}," after the last
__device__ long long put_slot(Output out, long long at, const RenderArgs& a, int r, int j, int k) {
    if (k < 0 || j > k) return at;
    if (j == 0) {
        at = put_entry(out, at, a.token_ids[r], a.logprobs[r], a.blob, a.text_at);
        at = put(out, at, ",\"top_logprobs\":[", 17);
    } else {
        const long long c = (long long)r * a.width + j - 1;
        at = put_entry(out, at, a.top_ids[c], a.top_lps[c], a.blob, a.text_at);
        at = put(out, at, "}", 1);
    }
    if (j == k) return put(out, at, "]},", 3);
    return j > 0 ? put(out, at, ",", 1) : at;
}

// Every thread of every block calls it. Each block measures every slot, and writes its share of
// them: one block writing them all is bound by its one SM's memory accesses (single bytes, to and
// from places far apart).
__device__ void render_rows(const RenderArgs& a) {
    __shared__ long long partial[RENDER_MAX_THREADS];
    const int t = threadIdx.x, threads = blockDim.x;
    const int rows = a.cu ? (int)min((long long)a.num_rows, a.cu[a.num_requests]) : a.num_rows;
    const int slots = a.width + 1;  // of each row
    const long long items = (long long)rows * slots;
    const long long chunk = (items + threads - 1) / threads;
    const long long lo = min(t * chunk, items), hi = min(lo + chunk, items);
    int b = 0;  // the request of slot lo's row
    if (a.cu) {
        const long long row = lo / slots;
        int l = 0, h = a.num_requests - 1;
        while (l < h) { const int mid = (l + h + 1) / 2; if (a.cu[mid] <= row) l = mid; else h = mid - 1; }
        b = l;
    }
    long long size = 0;
    for (long long i = lo, q = b; i < hi; ++i) {
        const int r = (int)(i / slots), j = (int)(i % slots);
        if (a.cu) { while (a.cu[q + 1] <= r) ++q; } else { q = r; }
        size = put_slot(Output{nullptr, 0}, size, a, r, j, (int)a.request_k[q]);
    }
    block_inclusive_scan(partial, size);  // of the chunk sizes
    const long long share = (items + gridDim.x - 1) / gridDim.x;  // slots this block writes
    const long long first = min(blockIdx.x * share, items), last = min(first + share, items);
    if (hi <= first || lo >= last) return;
    long long at = t > 0 ? partial[t - 1] : 0;
    for (long long i = lo, q = b; i < hi; ++i) {
        const int r = (int)(i / slots), j = (int)(i % slots);
        if (a.cu) { while (a.cu[q + 1] <= r) ++q; } else { q = r; }
        const bool mine = first <= i && i < last;
        at = put_slot(Output{mine ? a.out : nullptr, a.capacity}, at, a, r, j, (int)a.request_k[q]);
        if (mine && j == slots - 1) a.ends[r] = at;
    }
}
