/* Extend attention over the paged KV pool: prefill, prefill chunks and draft verification,
 * where each request brings several new queries that see its cached prefix and, causally,
 * each other.
 *
 * The torch path attends one request at a time with a gather, a copy per operand and dtype,
 * a materialized mask and two matmuls per block of queries: on a 3,790-token prefill chunk
 * of SmolLM2 that was ~0.85 s of 3.1. Here every request of the batch is attended in one
 * call: per (request, kv head) the keys are copied once into blocks of 32 keys laid out
 * dimension-major, so a block of 8 query rows computes 8 x 32 scores with one broadcast-FMA
 * per row and dimension; a row's softmax is taken over exactly the keys it may see (prefix +
 * its own position); P V runs four rows at a time with the output in registers. Work items
 * are (request, kv head, 8 new queries), handed out one at a time (schedule(dynamic, 1)),
 * so the causal mask's growing rows balance across threads; blocks past the diagonal are
 * never computed.
 *
 * Two precisions: float32 throughout (a float32 model gets float32 attention; 0.42 s for the
 * chunk above; in AVX-512 registers, or AVX2 ones: extend_attention_avx2.h), or, for a bfloat16 query and pool on a CPU with AVX512-BF16, vdpbf16ps on
 * pairs of bfloat16 values with float32 sums (0.20 s; extend_attention_bf16.h).
 *
 * The bfloat16 path runs its two products at the CPU's vdpbf16ps rate (one zmm a cycle on
 * AMD Zen 4: scores and P V are ~75% of a chunk), so what it saves is around them: the
 * softmax is one pass that exponentiates in base 2 with the scale folded into one FMA, sums
 * and writes bfloat16 P, with each row's max kept while the scores are stored (it was four
 * passes: max, exp in place, zeroing, conversion); keys are packed through a register
 * transpose; the output is rounded with vcvtneps2bf16. One thread, a 2,063-token chunk of
 * seven prompts (32-512 tokens, one with a 300-token prefix) of SmolLM2's shape (9 query
 * heads, 3 kv heads, head_dim 64), AMD EPYC: 9.8 -> 8.4 ms, the softmax ~5.3 -> ~3.3 Mcycles
 * (a shared machine: indicative). Flash-style online softmax was not needed: a query block's
 * scores (24 rows x at most ~2,000 keys) stay in L2, and the passes over them are now one.
 *
 * Where the CPU has AMX, a bfloat16 item is 16 queries and its two products run on tiles
 * (extend_attention_amx.h): the same chunk on a Xeon with AMX, one thread, 17.2 -> 5.6 ms.
 */
#include "common.h"
#include "kernel_entries.h"

#define KEY_BLOCK 32   /* keys per transposed block: two zmm of scores per row */
#define QUERY_BLOCK 8  /* new queries per work item; rows = group x QUERY_BLOCK */
_Static_assert(QUERY_BLOCK == 8, "a query block is one call of the 8-row score kernels");
#define MAX_EXT_GROUP 8
#define MAX_EXT_HEAD_DIM 256

/* Two bfloat16 values as one word, read and written through uint16_t memory. */
typedef uint32_t pair16 __attribute__((may_alias, aligned(2)));

#if defined(__AVX512F__)
/* scores[r][0 .. keys) = q_r . k for 8 rows of q (float32 [8][head_dim], pre-scaled) against
 * the transposed key blocks kt ([blocks][head_dim][KEY_BLOCK]). */
static void scores_8_rows(const float *q, int64_t head_dim, const float *kt, int64_t keys,
                          float *scores, int64_t score_stride) {
    for (int64_t kb = 0; kb * KEY_BLOCK < keys; kb++) {
        const float *block = kt + kb * head_dim * KEY_BLOCK;
        __m512 acc[8][2];
        for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int64_t d = 0; d < head_dim; d++) {
            const __m512 k0 = _mm512_loadu_ps(block + d * KEY_BLOCK);
            const __m512 k1 = _mm512_loadu_ps(block + d * KEY_BLOCK + 16);
            for (int r = 0; r < 8; r++) {
                const __m512 qd = _mm512_set1_ps(q[r * head_dim + d]);
                acc[r][0] = _mm512_fmadd_ps(qd, k0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(qd, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < 8; r++) {
            _mm512_storeu_ps(scores + r * score_stride + kb * KEY_BLOCK, acc[r][0]);
            _mm512_storeu_ps(scores + r * score_stride + kb * KEY_BLOCK + 16, acc[r][1]);
        }
    }
}

/* out_r = sum_j p_r[j] v_j for 4 rows of probabilities (zero past each row's keys), over
 * the 16 * WIDTH dimensions from `dim0` of the float32 values [keys][head_dim]. */
static inline __attribute__((always_inline)) void pv_4_rows(
    const float *p, int64_t p_stride, const float *v, int64_t head_dim, int64_t keys,
    int64_t dim0, float *out, int64_t out_stride, const int WIDTH)
{
    __m512 acc[4][4], vj[4];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < WIDTH; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < keys; j++) {
        for (int i = 0; i < WIDTH; i++) vj[i] = _mm512_loadu_ps(v + j * head_dim + dim0 + 16 * i);
        for (int r = 0; r < 4; r++) {
            const __m512 pj = _mm512_set1_ps(p[r * p_stride + j]);
            for (int i = 0; i < WIDTH; i++) acc[r][i] = _mm512_fmadd_ps(pj, vj[i], acc[r][i]);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < WIDTH; i++) _mm512_storeu_ps(out + r * out_stride + 16 * i, acc[r][i]);
}

/* A P V kernel (pv_4_rows or pv_4_rows_bf16) over every dimension, 64 at a time, each call
 * with a constant WIDTH of 16-dimension registers (so its accumulators stay in registers). */
#define PV_4_ROWS_ALL(kernel, p, p_stride, v, head_dim, keys, out, out_stride)                   \
    for (int64_t dim0 = 0; dim0 < (head_dim); dim0 += 64) {                                   \
        float *o = (out) + dim0;                                                               \
        switch (((head_dim) - dim0) >= 64 ? 4 : (int)((head_dim) - dim0) / 16) {               \
            case 4: kernel(p, p_stride, v, head_dim, keys, dim0, o, out_stride, 4); break;     \
            case 3: kernel(p, p_stride, v, head_dim, keys, dim0, o, out_stride, 3); break;     \
            case 2: kernel(p, p_stride, v, head_dim, keys, dim0, o, out_stride, 2); break;     \
            default: kernel(p, p_stride, v, head_dim, keys, dim0, o, out_stride, 1); break;    \
        }                                                                                      \
    }

/* The same two products over every row of a work item (rows a multiple of 8). */
static void scores_rows(const float *q, int64_t rows, int64_t head_dim, const float *kt,
                        int64_t keys, float *scores, int64_t score_stride) {
    for (int64_t r = 0; r < rows; r += 8)
        scores_8_rows(q + r * head_dim, head_dim, kt, keys, scores + r * score_stride, score_stride);
}

static void pv_rows(const float *p, int64_t p_stride, int64_t rows, const float *v,
                    int64_t head_dim, int64_t keys, float *out, int64_t out_stride) {
    for (int64_t r = 0; r < rows; r += 4)
        PV_4_ROWS_ALL(pv_4_rows, p + r * p_stride, p_stride, v, head_dim, keys,
                      out + r * out_stride, out_stride);
}
#endif

#include "extend_attention_avx2.h"
#include "extend_attention_bf16.h"
#include "extend_attention_amx.h"

/* Whether bfloat16 items run on AMX tiles where the CPU and the OS allow: on by default,
 * off after extend_attention_amx(0) (cpu_kernels.py's start-up check, benchmarks). */
static int amx_wanted = 1;

/* Sets whether to use AMX; returns whether bfloat16 extend attention now runs on it. */
int extend_attention_amx(int enable) {
    __atomic_store_n(&amx_wanted, enable, __ATOMIC_RELAXED);
#if defined(HAVE_AMX)
    return enable && amx_permitted();
#else
    return 0;
#endif
}

#if defined(__AVX512F__) || defined(HAVE_AVX2_FMA)
/* The finished rows of a work item (row g * qblock + i: query head h * group + g of new
 * token `token` + i, for i < count), each scaled by its 1 / softmax sum, into out. */
static void store_rows(float *acc, const float *inv, int64_t group, int64_t qblock,
                       int64_t count, int64_t token, int64_t num_heads, int64_t h,
                       int64_t head_dim, void *out, int out_dtype) {
    for (int64_t r = 0; r < group * qblock; r++) {
        const int64_t g = r / qblock, i = r % qblock;
        if (i >= count) continue;
        float *row = acc + r * head_dim;
        const int64_t dst = ((token + i) * num_heads + h * group + g) * head_dim;
#if defined(__AVX512F__)
        if (out_dtype == DT_BF16) { /* vcvtneps2bf16 where the scalar rounding was 5% */
            for (int64_t d = 0; d < head_dim; d += 16)
                _mm256_storeu_si256((__m256i *)((uint16_t *)out + dst + d),
                                    f32_to_bf16_16(_mm512_mul_ps(_mm512_loadu_ps(row + d),
                                                                 _mm512_set1_ps(inv[r]))));
            continue;
        }
#endif
        for (int64_t d = 0; d < head_dim; d++) row[d] *= inv[r];
        store_f32(out, out_dtype, dst, head_dim, row);
    }
}
#endif

/* q: [tokens, num_heads, head_dim] with token stride q_token_stride (elements); out the same
 * shape, contiguous. Request b's new tokens are extend_lens[b] consecutive tokens, at
 * positions prefix_lens[b] ..; its keys (prefix and new, already written) are in the pool at
 * req_to_token[req_pool_indices[b]][0 .. prefix + extend). Returns 0, -1 for shapes it does
 * not handle (head_dim not a multiple of 16 up to MAX_EXT_HEAD_DIM, group above
 * MAX_EXT_GROUP, neither AVX-512 nor AVX2 with FMA), -2 when out of memory. */
int extend_attention(const void *q, int q_dtype, int64_t q_token_stride,
                     const void *k_cache, const void *v_cache, int kv_dtype,
                     int64_t kv_head_stride, int64_t kv_slot_stride,
                     const int64_t *req_to_token, int64_t table_stride,
                     const int64_t *req_pool_indices, const int64_t *prefix_lens,
                     const int64_t *extend_lens, int64_t bs, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, float scale, void *out, int out_dtype)
{
#if !defined(__AVX512F__) && !defined(HAVE_AVX2_FMA)
    return -1;
#else
    const int64_t group = num_heads / num_kv_heads;
    if (head_dim % 16 != 0 || head_dim > MAX_EXT_HEAD_DIM || group > MAX_EXT_GROUP) return -1;
#if defined(__AVX512BF16__)
    const int bf16 = q_dtype == DT_BF16 && kv_dtype == DT_BF16;
#else
    const int bf16 = 0;
#endif
#if defined(HAVE_AMX)
    const int amx = bf16 && head_dim % AMX_KEY_STEP == 0 &&
                    __atomic_load_n(&amx_wanted, __ATOMIC_RELAXED) && amx_permitted();
#else
    const int amx = 0;
#endif
    const int64_t qblock = amx ? AMX_QUERY_BLOCK : QUERY_BLOCK; /* new queries per item */
    const size_t element = bf16 ? sizeof(uint16_t) : sizeof(float); /* of the K/V copies */
    /* Per request: where its new tokens start, and where its keys/values are copied to. */
    int64_t *token0 = malloc((size_t)(bs + 1) * sizeof(int64_t));
    int64_t *kv0 = malloc((size_t)(bs + 1) * sizeof(int64_t));
    int64_t *item0 = malloc((size_t)(bs + 1) * sizeof(int64_t));
    if (!token0 || !kv0 || !item0) {
        free(token0), free(kv0), free(item0);
        return -2;
    }
    token0[0] = kv0[0] = item0[0] = 0;
    int64_t max_keys = 0;
    for (int64_t b = 0; b < bs; b++) {
        const int64_t keys = prefix_lens[b] + extend_lens[b];
        const int64_t padded = (keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
        max_keys = padded > max_keys ? padded : max_keys;
        token0[b + 1] = token0[b] + extend_lens[b];
        kv0[b + 1] = kv0[b] + padded * head_dim; /* elements per kv head */
        item0[b + 1] = item0[b] + (extend_lens[b] + qblock - 1) / qblock;
    }
    char *kt = malloc((size_t)(kv0[bs] * num_kv_heads) * element);
    char *vt = malloc((size_t)(kv0[bs] * num_kv_heads) * element);
    if (!kt || !vt) {
        free(kt), free(vt), free(token0), free(kv0), free(item0);
        return -2;
    }
    const int64_t rows = group * qblock;
    int failed = 0;

#pragma omp parallel
    {
        /* 1: each request's keys, transposed into key blocks, and its values: float32, or
         * bfloat16 in dimension pairs for vdpbf16ps. Padding keys are zeros: finite scores
         * that no row reads. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < bs * num_kv_heads; item++) {
            const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
            const int64_t keys = prefix_lens[b] + extend_lens[b];
            const int64_t padded = (kv0[b + 1] - kv0[b]) / head_dim;
            const int64_t *slots = req_to_token + req_pool_indices[b] * table_stride;
            const int64_t base = kv0[b] * num_kv_heads + h * (kv0[b + 1] - kv0[b]);
#if defined(__AVX512BF16__)
            if (bf16) {
                uint16_t *kp = (uint16_t *)kt + base, *vp = (uint16_t *)vt + base;
                memset(vp + keys / 2 * 2 * head_dim, 0, (size_t)((padded - keys / 2 * 2) * head_dim) * element);
                /* A pair of keys' values moves as one 32-bit word, a loop that vectorizes. */
                const uint16_t *v_head = (const uint16_t *)v_cache + h * kv_head_stride;
                pack_keys_bf16((const uint16_t *)k_cache + h * kv_head_stride, kv_slot_stride,
                               slots, keys, padded, head_dim, kp);
                for (int64_t j = 0; j < keys; j += 2) {
                    const uint16_t *v0 = v_head + slots[j] * kv_slot_stride;
                    const uint16_t *v1 = j + 1 < keys ? v_head + slots[j + 1] * kv_slot_stride : v0;
                    const uint32_t second = j + 1 < keys ? 0xffffu : 0u; /* a lone last key */
                    pair16 *vpair = (pair16 *)(vp + (j / 2) * head_dim * 2);
                    for (int64_t d = 0; d < head_dim; d++)
                        vpair[d] = (uint32_t)v0[d] | ((uint32_t)v1[d] & second) << 16;
                }
                continue;
            }
#endif
            float *kf = (float *)kt + base, *vf = (float *)vt + base;
            float row[MAX_EXT_HEAD_DIM];
            for (int64_t j = 0; j < padded; j++) {
                const int64_t offset = h * kv_head_stride + slots[j < keys ? j : 0] * kv_slot_stride;
                if (j < keys) load_f32(k_cache, kv_dtype, offset, head_dim, row);
                else memset(row, 0, (size_t)head_dim * sizeof(float));
                float *block = kf + (j / KEY_BLOCK) * head_dim * KEY_BLOCK + j % KEY_BLOCK;
                for (int64_t d = 0; d < head_dim; d++) block[d * KEY_BLOCK] = row[d];
                if (j < keys) load_f32(v_cache, kv_dtype, offset, head_dim, vf + j * head_dim);
            }
        }

        /* 2: per (request, kv head, block of new queries): scores, softmax, P V. */
        float *qf = malloc((size_t)(rows * head_dim) * sizeof(float));
        float *scores = malloc((size_t)(rows * max_keys) * sizeof(float));
        uint16_t *p16 = malloc((size_t)(rows * max_keys) * sizeof(uint16_t));
        float *acc = malloc((size_t)(rows * head_dim) * sizeof(float));
        if (!qf || !scores || !p16 || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#if defined(HAVE_AMX)
        if (amx) amx_configure(); /* per thread */
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < item0[bs] * num_kv_heads; item++) {
            if (failed) continue;
            const int64_t block_item = item / num_kv_heads, h = item % num_kv_heads;
            int64_t lo = 0, hi = bs; /* the request whose query blocks include block_item */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (item0[mid] <= block_item) lo = mid; else hi = mid;
            }
            const int64_t b = lo, prefix = prefix_lens[b];
            const int64_t first = (block_item - item0[b]) * qblock;
            const int64_t count = extend_lens[b] - first < qblock ? extend_lens[b] - first : qblock;
            const int64_t visible = prefix + first + count; /* keys the block's last query sees */
            const int64_t base = kv0[b] * num_kv_heads + h * (kv0[b + 1] - kv0[b]);
            float inv[MAX_EXT_GROUP * AMX_QUERY_BLOCK]; /* each row's 1 / softmax sum */
#if defined(HAVE_AMX)
            if (amx) {
                attend_item_amx((const uint16_t *)q, q_token_stride, token0[b] + first, count,
                                prefix + first, (const uint16_t *)kt + base,
                                (const uint16_t *)vt + base, h, group, head_dim, scale,
                                max_keys, (uint16_t *)qf, scores, p16, acc, inv);
                store_rows(acc, inv, group, qblock, count, token0[b] + first, num_heads, h,
                           head_dim, out, out_dtype);
                continue;
            }
#endif
            /* A whole bfloat16 block reads its queries where they are (rows q_token_stride
             * apart); otherwise row g * QUERY_BLOCK + i, query head h * group + g of new
             * token first + i, is copied to qf: float32 pre-scaled, or the bfloat16 it is
             * (qf's bytes hold either), zeros past the block's count. */
            const int in_place = bf16 && count == QUERY_BLOCK && q_token_stride % 2 == 0;
            for (int64_t g = 0; !in_place && g < group; g++)
                for (int64_t i = 0; i < QUERY_BLOCK; i++) {
                    const int64_t r = g * QUERY_BLOCK + i;
                    const int64_t src = (token0[b] + first + i) * q_token_stride + (h * group + g) * head_dim;
                    if (bf16) {
                        uint16_t *dst = (uint16_t *)qf + r * head_dim;
                        if (i < count) memcpy(dst, (const uint16_t *)q + src, (size_t)head_dim * 2);
                        else memset(dst, 0, (size_t)head_dim * 2);
                        continue;
                    }
                    float *dst = qf + r * head_dim;
                    if (i >= count) {
                        memset(dst, 0, (size_t)head_dim * sizeof(float));
                        continue;
                    }
                    load_f32(q, q_dtype, src, head_dim, dst);
                    for (int64_t d = 0; d < head_dim; d++) dst[d] *= scale;
                }
            /* Row g * QUERY_BLOCK + i sees the prefix, the new tokens before it and itself. */
            int64_t seen[QUERY_BLOCK];
            for (int64_t i = 0; i < QUERY_BLOCK; i++) seen[i] = i < count ? prefix + first + i + 1 : 0;
#if defined(__AVX512BF16__)
            if (bf16) {
                float row_max[MAX_EXT_GROUP * QUERY_BLOCK], top[QUERY_BLOCK * 16];
                for (int64_t r = 0; r < rows; r += QUERY_BLOCK) {
                    for (int i = 0; i < QUERY_BLOCK * 16; i++) top[i] = -INFINITY;
                    const int64_t g = r / QUERY_BLOCK;
                    const uint16_t *rows_q =
                        in_place ? (const uint16_t *)q + (token0[b] + first) * q_token_stride +
                                       (h * group + g) * head_dim
                                 : (const uint16_t *)qf + r * head_dim;
                    scores_8_rows_bf16(rows_q, in_place ? q_token_stride : head_dim, head_dim,
                                       (const uint16_t *)kt + base, visible,
                                       scores + r * max_keys, max_keys, seen[0], count, top);
                    for (int64_t i = 0; i < QUERY_BLOCK; i++)
                        row_max[r + i] = _mm512_reduce_max_ps(_mm512_loadu_ps(top + 16 * i));
                }
                /* Up to an even count of keys: P V takes bfloat16 probabilities in pairs. */
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t i = r % QUERY_BLOCK;
                    const float *s = scores + r * max_keys;
                    const float sum = softmax_numerators_bf16(s, seen[i], visible + (visible & 1),
                                                              row_max[r], scale,
                                                              p16 + r * max_keys);
                    inv[r] = seen[i] ? 1.f / sum : 0.f;
                }
            }
#endif
            if (!bf16)
                scores_rows(qf, rows, head_dim, (const float *)kt + base, visible, scores, max_keys);
            for (int64_t r = 0; !bf16 && r < rows; r++) {
                float *s = scores + r * max_keys;
                const int64_t i = r % QUERY_BLOCK;
                inv[r] = seen[i] ? 1.f / exp_shifted_sum(s, seen[i], max_f32(s, seen[i])) : 0.f;
                /* Up to the keys P V reads: zeros past the row's own. */
                for (int64_t j = seen[i]; j < visible; j++) s[j] = 0.f;
            }
#if defined(__AVX512BF16__)
            for (int64_t r = 0; bf16 && r < rows; r += 4)
                pv_4_rows_all_bf16(p16 + r * max_keys, max_keys, (const uint16_t *)vt + base,
                                   head_dim, visible, acc + r * head_dim, head_dim);
#endif
            if (!bf16)
                pv_rows(scores, max_keys, rows, (const float *)vt + base, head_dim, visible, acc,
                        head_dim);
            store_rows(acc, inv, group, QUERY_BLOCK, count, token0[b] + first, num_heads, h,
                       head_dim, out, out_dtype);
        }
#if defined(HAVE_AMX)
        if (amx) amx_release();
#endif
        free(qf), free(scores), free(p16), free(acc);
    }
    free(kt), free(vt), free(token0), free(kv0), free(item0);
    return failed ? -2 : 0;
#endif
}
