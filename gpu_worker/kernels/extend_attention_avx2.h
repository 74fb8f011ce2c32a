/* The float32 products of extend_attention.c on a CPU with AVX2 and FMA but no AVX-512
 * (AMD Zen 2/3, Intel before Skylake-X): the same layouts and contracts as its AVX-512
 * scores_rows and pv_rows, in 8-float registers. Included by extend_attention.c once it has
 * defined KEY_BLOCK; every function here is static to it.
 *
 * Both products run on gemm_f32's micro-tile, 6 rows x 16 columns: 12 accumulators, two
 * loaded vectors and six broadcasts for 12 FMAs. The 2 x 32 tile this had before loaded four
 * vectors for 8 FMAs: in P V those came from L2 (a request's values are up to 128 KB), 128
 * bytes per 4 cycles, which is Zen 3's L2 bandwidth, and P V took 46% of the kernel's time
 * to the scores' 35% (perf, mixed-64's prompts). */
#pragma once

#include "common.h"
#if defined(HAVE_AVX2_FMA) && !defined(__AVX512F__)

/* out[r][0 .. 16) = sum_k a[r][k] b[k][0 .. 16) for R rows of a (row stride a_stride, k
 * stride 1) and b's 16 columns at stride b_stride, k < n: the scores (a = queries, b = a
 * transposed key block) and P V (a = probabilities, b = values) alike. */
#define ATTEND_TILE(R)                                                                        \
    static inline void attend_tile_##R(const float *a, int64_t a_stride, const float *b,     \
                                       int64_t b_stride, int64_t n, float *out,              \
                                       int64_t out_stride) {                                 \
        __m256 acc[R][2];                                                                     \
        UNROLLED for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();     \
        FMA_TILE_16(R, acc, a, a_stride, b, b_stride, n, NULL);                               \
        UNROLLED for (int r = 0; r < R; r++) {                                                \
            _mm256_storeu_ps(out + r * out_stride, acc[r][0]);                                \
            _mm256_storeu_ps(out + r * out_stride + 8, acc[r][1]);                            \
        }                                                                                     \
    }
EACH_TILE_ROWS(ATTEND_TILE)

/* scores[r][0 .. keys) = q_r . k for `rows` rows of q (float32 [rows][head_dim],
 * pre-scaled) against the transposed key blocks kt ([blocks][head_dim][KEY_BLOCK]), in
 * tiles of 16 keys: up to 15 columns past `keys` hold padding sums that no row reads, and
 * a block's second tile is skipped where it holds no key (4% of the scores' work on
 * mixed-64's prompts, whose blocks of 8 queries see ~180 keys on average). */
static void scores_rows(const float *q, int64_t rows, int64_t head_dim, const float *kt,
                        int64_t keys, float *scores, int64_t score_stride) {
    _Static_assert(KEY_BLOCK % 16 == 0, "a block is whole tiles of 16 keys");
    for (int64_t kb = 0; kb * KEY_BLOCK < keys; kb++)
        for (int64_t c = 0; c < KEY_BLOCK && kb * KEY_BLOCK + c < keys; c += 16) /* in L1 */
            for (int64_t r = 0; r < rows; r += 6)
                TILE_OF_ROWS(attend_tile, rows - r, q + r * head_dim, head_dim,
                             kt + kb * head_dim * KEY_BLOCK + c, KEY_BLOCK, head_dim,
                             scores + r * score_stride + kb * KEY_BLOCK + c, score_stride);
}

/* out_r = sum_j p_r[j] v_j for `rows` rows of probabilities (zero past each row's keys)
 * over the float32 values [keys][head_dim] (head_dim a multiple of 16). */
static void pv_rows(const float *p, int64_t p_stride, int64_t rows, const float *v,
                    int64_t head_dim, int64_t keys, float *out, int64_t out_stride) {
    for (int64_t d = 0; d < head_dim; d += 16) /* 16 dims of every value: 64 B a key */
        for (int64_t r = 0; r < rows; r += 6)
            TILE_OF_ROWS(attend_tile, rows - r, p + r * p_stride, p_stride, v + d, head_dim,
                         keys, out + r * out_stride + d, out_stride);
}
#endif
