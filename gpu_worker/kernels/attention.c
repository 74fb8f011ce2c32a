/* Attention over the paged KV pool: the new tokens' K/V written into their slots, and decode
 * attention (one new query per request) reading each cached K and V row once, straight from
 * the pool. The torch path gathers them into a padded copy first and then reads the copy:
 * three passes over the bytes instead of one.
 */
#include "common.h"
#include "kernel_entries.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16

/* Slots are indirect, so the hardware prefetcher cannot follow them: ask for rows ahead,
 * into L1 for the pass under way, or into L2 for one this work item reads after it. */
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif
static inline void prefetch_row(const void *base, int dtype, int64_t offset, int64_t bytes,
                                int into_l2) {
    const char *p = (const char *)base + offset * (dtype == DT_F32 ? 4 : 2);
    for (int64_t b = 0; b < bytes; b += 64) {
        if (into_l2) __builtin_prefetch(p + b, 0, 2);
        else __builtin_prefetch(p + b, 0, 3);
    }
}
static inline const void *kv_head(const void *cache, int dtype, int64_t h, int64_t head_stride) {
    return (const char *)cache + h * head_stride * (dtype == DT_F32 ? 4 : 2);
}

#if defined(__AVX512F__)
/* The 64 dimensions of row j (at slots[j]) of one head into four registers, asking for the
 * row PREFETCH_ROWS ahead: the key pass and the value pass read their rows alike. */
static inline __attribute__((always_inline)) void load_row_d64(
    const void *head, int dtype, const int64_t *slots, int64_t stride, int64_t j, int64_t n,
    __m512 row[4])
{
    if (j + PREFETCH_ROWS < n) prefetch_row(head, dtype, slots[j + PREFETCH_ROWS] * stride, 128, 0);
    const int64_t off = slots[j] * stride;
    for (int i = 0; i < 4; i++) row[i] = load16(head, dtype, off + 16 * i);
}

/* One chunk of keys for a group of G query heads with head_dim 64, every running sum in
 * registers: with them in memory each key's update waited on the last one's store, and
 * fewer rows were in flight than the memory system can serve. The key pass also asks, into
 * L2, for the same slot's value row and for its key row of the next kv head (next_k; NULL
 * after the last), which this work item reads next: three runs of the pool streamed side by
 * side, where reading one at a time held decode attention to ~16 GB/s on two cores of a
 * host that streams 45 (the engine's own calls replayed: 0.71 -> 0.59 ms; benchmarks/NOTES.md,
 * 2026-11-27 (later)). */
static inline __attribute__((always_inline)) void attend_chunk_d64(
    const float (*qf)[MAX_HEAD_DIM], const void *k_head, const void *v_head, int dtype,
    const int64_t *slots, int64_t stride, int64_t n, float *scores, int64_t chunk, const int G,
    float *state, int64_t state_stride, const void *next_k)
{
    for (int64_t j = 0; j < n; j++) {
        __m512 k[4];
        const int64_t row_bytes = 64 * (dtype == DT_F32 ? 4 : 2);
        if (next_k) prefetch_row(next_k, dtype, slots[j] * stride, row_bytes, 1);
        prefetch_row(v_head, dtype, slots[j] * stride, row_bytes, 1);
        load_row_d64(k_head, dtype, slots, stride, j, n, k);
        for (int g = 0; g < G; g++) {
            __m512 d = _mm512_mul_ps(k[0], _mm512_loadu_ps(qf[g]));
            d = _mm512_fmadd_ps(k[1], _mm512_loadu_ps(qf[g] + 16), d);
            d = _mm512_fmadd_ps(k[2], _mm512_loadu_ps(qf[g] + 32), d);
            d = _mm512_fmadd_ps(k[3], _mm512_loadu_ps(qf[g] + 48), d);
            scores[g * chunk + j] = _mm512_reduce_add_ps(d);
        }
    }
    for (int g = 0; g < G; g++) {
        float *sc = scores + g * chunk;
        const float m = max_f32(sc, n);
        state[g * state_stride] = m;
        state[g * state_stride + 1] = exp_shifted_sum(sc, n, m);
    }
    __m512 acc[4][4];
    for (int g = 0; g < G; g++) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        __m512 v[4];
        load_row_d64(v_head, dtype, slots, stride, j, n, v);
        for (int g = 0; g < G; g++) {
            const __m512 p = _mm512_set1_ps(scores[g * chunk + j]);
            for (int i = 0; i < 4; i++) acc[g][i] = _mm512_fmadd_ps(p, v[i], acc[g][i]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(state + g * state_stride + 2 + 16 * i, acc[g][i]);
}
#elif defined(HAVE_AVX2_FMA)
/* attend_chunk_d64 in the 16 ymm registers AVX2 has: each key row in eight of them, and the
 * value sums in passes of 32 dimensions (16 for four query heads) over the chunk's rows, so
 * a pass's sums stay in registers; the rows come from L1 or L2 after the first pass, which
 * the key pass prefetched. Where this took the generic path (a row copied, each query head's
 * value sums loaded and stored in L1 per row), decode attention was 16% of a float32
 * mixed-64 run's samples. */
static inline __attribute__((always_inline)) void attend_chunk_d64(
    const float (*qf)[MAX_HEAD_DIM], const void *k_head, const void *v_head, int dtype,
    const int64_t *slots, int64_t stride, int64_t n, float *scores, int64_t chunk, const int G,
    float *state, int64_t state_stride, const void *next_k)
{
    const int64_t row_bytes = 64 * (dtype == DT_F32 ? 4 : 2);
    for (int64_t j = 0; j < n; j++) {
        if (next_k) prefetch_row(next_k, dtype, slots[j] * stride, row_bytes, 1);
        prefetch_row(v_head, dtype, slots[j] * stride, row_bytes, 1);
        if (j + PREFETCH_ROWS < n) prefetch_row(k_head, dtype, slots[j + PREFETCH_ROWS] * stride, row_bytes, 0);
        const int64_t off = slots[j] * stride;
        __m256 k[8];
        for (int i = 0; i < 8; i++) k[i] = load8(k_head, dtype, off + 8 * i);
        for (int g = 0; g < G; g++) { /* two chains: half the latency of one */
            __m256 d0 = _mm256_mul_ps(k[0], _mm256_loadu_ps(qf[g]));
            __m256 d1 = _mm256_mul_ps(k[1], _mm256_loadu_ps(qf[g] + 8));
            for (int i = 2; i < 8; i += 2) {
                d0 = _mm256_fmadd_ps(k[i], _mm256_loadu_ps(qf[g] + 8 * i), d0);
                d1 = _mm256_fmadd_ps(k[i + 1], _mm256_loadu_ps(qf[g] + 8 * i + 8), d1);
            }
            scores[g * chunk + j] = hsum8(_mm256_add_ps(d0, d1));
        }
    }
    for (int g = 0; g < G; g++) {
        float *sc = scores + g * chunk;
        const float m = max_f32(sc, n);
        state[g * state_stride] = m;
        state[g * state_stride + 1] = exp_shifted_sum(sc, n, m);
    }
    const int per_pass = G <= 3 ? 4 : 2; /* ymm of value sums a query head keeps a pass */
    for (int first = 0; first < 8; first += per_pass) {
        __m256 acc[4][4];
        for (int g = 0; g < G; g++)
            for (int i = 0; i < per_pass; i++) acc[g][i] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            if (first == 0 && j + PREFETCH_ROWS < n)
                prefetch_row(v_head, dtype, slots[j + PREFETCH_ROWS] * stride, row_bytes, 0);
            const int64_t off = slots[j] * stride + 8 * first;
            for (int g = 0; g < G; g++) {
                const __m256 p = _mm256_broadcast_ss(scores + g * chunk + j);
                for (int i = 0; i < per_pass; i++)
                    acc[g][i] = _mm256_fmadd_ps(p, load8(v_head, dtype, off + 8 * i), acc[g][i]);
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < per_pass; i++)
                _mm256_storeu_ps(state + g * state_stride + 2 + 8 * (first + i), acc[g][i]);
    }
}
#endif

/* One chunk of keys for a group of G query heads of any head_dim (the path attend_chunk_d64
 * does not take): the same partial softmax state, its value sums in L1 accumulators. */
static inline __attribute__((always_inline)) void attend_chunk_any(
    const float (*qf)[MAX_HEAD_DIM], const void *k_head, const void *v_head, int dtype,
    const int64_t *slots, int64_t stride, int64_t n, int64_t head_dim, int64_t group,
    float *scores, int64_t chunk, float (*acc)[MAX_HEAD_DIM], float *row, float *state,
    int64_t state_stride)
{
    for (int64_t g = 0; g < group; g++) memset(acc[g], 0, (size_t)head_dim * sizeof(float));
    /* scores[g][j] = q_g . k_j */
    const int64_t row_bytes = head_dim * (dtype == DT_F32 ? 4 : 2);
    for (int64_t j = 0; j < n; j++) {
        if (j + PREFETCH_ROWS < n) prefetch_row(k_head, dtype, slots[j + PREFETCH_ROWS] * stride, row_bytes, 0);
#if defined(__AVX512F__)
        if (head_dim % 16 == 0) {
            /* Registers, not a row buffer: the group's dot products are independent
             * chains the core overlaps, ending in one tree reduction each. */
            __m512 dots[MAX_GROUP];
            for (int64_t g = 0; g < group; g++) dots[g] = _mm512_setzero_ps();
            for (int64_t d = 0; d < head_dim; d += 16) {
                const __m512 kv = load16(k_head, dtype, slots[j] * stride + d);
                for (int64_t g = 0; g < group; g++)
                    dots[g] = _mm512_fmadd_ps(kv, _mm512_loadu_ps(qf[g] + d), dots[g]);
            }
            for (int64_t g = 0; g < group; g++) scores[g * chunk + j] = _mm512_reduce_add_ps(dots[g]);
            continue;
        }
#endif
        load_f32(k_head, dtype, slots[j] * stride, head_dim, row);
        for (int64_t g = 0; g < group; g++) scores[g * chunk + j] = dot_f32(qf[g], row, head_dim);
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * chunk;
        const float m = max_f32(s, n);
        state[g * state_stride] = m;
        state[g * state_stride + 1] = exp_shifted_sum(s, n, m);
    }
    /* acc[g] = sum_j p[g][j] v_j, in L1-resident accumulators */
    for (int64_t j = 0; j < n; j++) {
        if (j + PREFETCH_ROWS < n) prefetch_row(v_head, dtype, slots[j + PREFETCH_ROWS] * stride, row_bytes, 0);
#if defined(__AVX512F__)
        if (head_dim % 16 == 0) {
            for (int64_t d = 0; d < head_dim; d += 16) {
                const __m512 vv = load16(v_head, dtype, slots[j] * stride + d);
                for (int64_t g = 0; g < group; g++)
                    _mm512_storeu_ps(acc[g] + d, _mm512_fmadd_ps(_mm512_set1_ps(scores[g * chunk + j]), vv, _mm512_loadu_ps(acc[g] + d)));
            }
            continue;
        }
#endif
        load_f32(v_head, dtype, slots[j] * stride, head_dim, row);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * chunk + j];
            float *a = acc[g];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) a[d] += p * row[d];
        }
    }
    for (int64_t g = 0; g < group; g++)
        memcpy(state + g * state_stride + 2, acc[g], (size_t)head_dim * sizeof(float));
}

/* Work item (request b, key chunk c; one kv head, or all of them where attend_chunk_d64
 * runs) -> partial softmax state per query head: max score m, sum of exp l, and
 * acc = sum_j exp(s_j - m) v_j, combined afterwards (split-K, as flash-decoding does, so one
 * long request still uses every thread). */
int paged_decode_attention(
    const void *q, int q_dtype, int64_t q_row_stride, /* [bs, num_heads, head_dim], rows strided */
    const void *k_cache, const void *v_cache, int kv_dtype,
    int64_t kv_head_stride, int64_t kv_slot_stride, /* elements; head_dim is contiguous */
    const int64_t *req_to_token, int64_t table_stride,
    const int64_t *req_pool_indices, const int64_t *seq_lens, /* [bs] */
    int64_t bs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, float scale,
    int64_t chunk, void *out, int out_dtype) /* out: [bs, num_heads, head_dim] contiguous */
{
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim > MAX_HEAD_DIM || group > MAX_GROUP || chunk < 1) return -1;
    int64_t *first_chunk = malloc((size_t)(bs + 1) * sizeof(int64_t));
    if (!first_chunk) return -2;
    first_chunk[0] = 0;
    for (int64_t b = 0; b < bs; b++)
        first_chunk[b + 1] = first_chunk[b] + (seq_lens[b] + chunk - 1) / chunk;
    const int64_t num_chunks = first_chunk[bs];
    const int64_t state = head_dim + 2; /* m, l, acc[head_dim] */
    float *partial = malloc((size_t)(num_chunks * num_heads * state) * sizeof(float));
    if (!partial) {
        free(first_chunk);
        return -2;
    }

#if defined(__AVX512F__) || defined(HAVE_AVX2_FMA)
    /* head_dim 64, up to 4 query heads a kv head: a work item is a chunk of every kv head,
     * attended head after head, each prefetching the next (attend_chunk_d64). */
    const int all_heads = head_dim == 64 && group <= 4;
#else
    const int all_heads = 0;
#endif
    const int64_t item_heads = all_heads ? 1 : num_kv_heads; /* work items per key chunk */
#pragma omp parallel
    {
        float qf[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM];
        float *scores = malloc((size_t)(group * chunk) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_chunks * item_heads; item++) {
            const int64_t global_chunk = item / item_heads, kvh = item % item_heads;
            int64_t lo = 0, hi = bs; /* the request whose chunks include global_chunk */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (first_chunk[mid] <= global_chunk) lo = mid; else hi = mid;
            }
            const int64_t b = lo;
            const int64_t start = (global_chunk - first_chunk[b]) * chunk;
            const int64_t stop = start + chunk < seq_lens[b] ? start + chunk : seq_lens[b];
            const int64_t n = stop - start;
            const int64_t *slots = req_to_token + req_pool_indices[b] * table_stride + start;
            /* Every kv head where a work item covers them all, else the item's own. */
            const int64_t first_head = all_heads ? 0 : kvh, end_head = all_heads ? num_kv_heads : kvh + 1;
            for (int64_t h = first_head; h < end_head; h++) {
                const void *k_head = kv_head(k_cache, kv_dtype, h, kv_head_stride);
                const void *v_head = kv_head(v_cache, kv_dtype, h, kv_head_stride);
                for (int64_t g = 0; g < group; g++) {
                    load_f32(q, q_dtype, b * q_row_stride + (h * group + g) * head_dim, head_dim, qf[g]);
                    for (int64_t d = 0; d < head_dim; d++) qf[g][d] *= scale;
                }
                float *st = partial + ((global_chunk * num_heads) + h * group) * state;
#if defined(__AVX512F__) || defined(HAVE_AVX2_FMA)
                if (all_heads) {
                    const void *next_k = h + 1 < num_kv_heads ? kv_head(k_cache, kv_dtype, h + 1, kv_head_stride) : NULL;
                    switch (group) { /* a constant G per call: registers */
                        case 1: attend_chunk_d64(qf, k_head, v_head, kv_dtype, slots, kv_slot_stride, n, scores, chunk, 1, st, state, next_k); break;
                        case 2: attend_chunk_d64(qf, k_head, v_head, kv_dtype, slots, kv_slot_stride, n, scores, chunk, 2, st, state, next_k); break;
                        case 3: attend_chunk_d64(qf, k_head, v_head, kv_dtype, slots, kv_slot_stride, n, scores, chunk, 3, st, state, next_k); break;
                        default: attend_chunk_d64(qf, k_head, v_head, kv_dtype, slots, kv_slot_stride, n, scores, chunk, 4, st, state, next_k); break;
                    }
                    continue;
                }
#endif
                attend_chunk_any(qf, k_head, v_head, kv_dtype, slots, kv_slot_stride, n, head_dim,
                                 group, scores, chunk, acc, row, st, state);
            }
        }
        free(scores);

#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < bs * num_heads; bh++) {
            const int64_t b = bh / num_heads, h = bh % num_heads;
            float m = -INFINITY, l = 0.f;
            for (int64_t c = first_chunk[b]; c < first_chunk[b + 1]; c++)
                m = partial[(c * num_heads + h) * state] > m ? partial[(c * num_heads + h) * state] : m;
            for (int64_t d = 0; d < head_dim; d++) row[d] = 0.f;
            for (int64_t c = first_chunk[b]; c < first_chunk[b + 1]; c++) {
                const float *st = partial + (c * num_heads + h) * state;
                const float w = expf(st[0] - m);
                l += st[1] * w;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) row[d] += w * st[2 + d];
            }
            const float inv = l > 0.f ? 1.f / l : 0.f;
            for (int64_t d = 0; d < head_dim; d++) row[d] *= inv;
            store_f32(out, out_dtype, bh * head_dim, head_dim, row);
        }
    }
    free(partial);
    free(first_chunk);
    return 0;
}

/* The new tokens' K and V rows into their pool slots (one call for both, where torch's
 * indexed assignment took two ops of ~25 us each per layer): src rows [tokens, kv_heads *
 * head_dim] with row strides, copied, or rounded to the pool's dtype as .to() would. */
int write_kv(const void *k_new, const void *v_new, int new_dtype, int64_t k_row_stride,
             int64_t v_row_stride, const int64_t *loc, int64_t tokens, int64_t num_kv_heads,
             int64_t head_dim, void *k_cache, void *v_cache, int kv_dtype,
             int64_t kv_head_stride, int64_t kv_slot_stride)
{
#pragma omp parallel for schedule(static) if (tokens * num_kv_heads * head_dim >= 65536)
    for (int64_t item = 0; item < tokens * num_kv_heads; item++) {
        const int64_t t = item / num_kv_heads, h = item % num_kv_heads;
        float row[head_dim];
        const int64_t dst = h * kv_head_stride + loc[t] * kv_slot_stride;
        if (new_dtype == kv_dtype) {
            /* A copy: through float32, store_f32's bfloat16 rounding (a NaN branch per
             * element) did not vectorize, 1.7x the copy's time. */
            const size_t size = new_dtype == DT_BF16 ? 2 : 4, bytes = (size_t)head_dim * size;
            const int64_t k_src = t * k_row_stride + h * head_dim;
            const int64_t v_src = t * v_row_stride + h * head_dim;
            memcpy((char *)k_cache + dst * size, (const char *)k_new + k_src * size, bytes);
            memcpy((char *)v_cache + dst * size, (const char *)v_new + v_src * size, bytes);
            continue;
        }
        load_f32(k_new, new_dtype, t * k_row_stride + h * head_dim, head_dim, row);
        store_f32(k_cache, kv_dtype, dst, head_dim, row);
        load_f32(v_new, new_dtype, t * v_row_stride + h * head_dim, head_dim, row);
        store_f32(v_cache, kv_dtype, dst, head_dim, row);
    }
    return 0;
}
