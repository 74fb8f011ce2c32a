/* The float32 products of extend_attention.c on a CPU with AVX2 and FMA but no AVX-512
 * (AMD Zen 2/3, Intel before Skylake-X): the same layouts and contracts as its AVX-512
 * scores_8_rows and pv_4_rows_all, in 8-float registers. Included by extend_attention.c once
 * it has defined KEY_BLOCK; every function here is static to it.
 *
 * There are 16 ymm registers, so a tile is 4 rows x 16 columns: 8 accumulators (as many as
 * two FMA pipes of latency 4 keep busy), two operand vectors and one broadcast. The AVX-512
 * tiles (8 x 32 scores, 4 x 64 outputs) are covered by four and four of these. */
#pragma once

#include "common.h"
#if defined(HAVE_AVX2_FMA) && !defined(__AVX512F__)

/* scores[r][0 .. keys) = q_r . k for 8 rows of q (float32 [8][head_dim], pre-scaled) against
 * the transposed key blocks kt ([blocks][head_dim][KEY_BLOCK]); columns from `keys` up to
 * the next 16 hold padding sums that no row reads. */
static void scores_8_rows(const float *q, int64_t head_dim, const float *kt, int64_t keys,
                          float *scores, int64_t score_stride) {
    for (int64_t key0 = 0; key0 < keys; key0 += 16) {
        const float *block = kt + key0 / KEY_BLOCK * head_dim * KEY_BLOCK + key0 % KEY_BLOCK;
        for (int r0 = 0; r0 < 8; r0 += 4) {
            const float *qr = q + r0 * head_dim;
            __m256 acc[4][2];
            for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d++) {
                const __m256 k0 = _mm256_loadu_ps(block + d * KEY_BLOCK);
                const __m256 k1 = _mm256_loadu_ps(block + d * KEY_BLOCK + 8);
                for (int r = 0; r < 4; r++) {
                    const __m256 qd = _mm256_broadcast_ss(qr + r * head_dim + d);
                    acc[r][0] = _mm256_fmadd_ps(qd, k0, acc[r][0]);
                    acc[r][1] = _mm256_fmadd_ps(qd, k1, acc[r][1]);
                }
            }
            for (int r = 0; r < 4; r++) {
                float *row = scores + (r0 + r) * score_stride + key0;
                _mm256_storeu_ps(row, acc[r][0]);
                _mm256_storeu_ps(row + 8, acc[r][1]);
            }
        }
    }
}

/* out_r = sum_j p_r[j] v_j for 4 rows of probabilities (zero past each row's keys) and the
 * float32 values [keys][head_dim], 16 dimensions at a time (head_dim is a multiple of 16). */
static void pv_4_rows_all(const float *p, int64_t p_stride, const float *v, int64_t head_dim,
                          int64_t keys, float *out, int64_t out_stride) {
    for (int64_t dim0 = 0; dim0 < head_dim; dim0 += 16) {
        __m256 acc[4][2];
        for (int r = 0; r < 4; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < keys; j++) {
            const __m256 v0 = _mm256_loadu_ps(v + j * head_dim + dim0);
            const __m256 v1 = _mm256_loadu_ps(v + j * head_dim + dim0 + 8);
            for (int r = 0; r < 4; r++) {
                const __m256 pj = _mm256_broadcast_ss(p + r * p_stride + j);
                acc[r][0] = _mm256_fmadd_ps(pj, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(pj, v1, acc[r][1]);
            }
        }
        for (int r = 0; r < 4; r++) {
            _mm256_storeu_ps(out + r * out_stride + dim0, acc[r][0]);
            _mm256_storeu_ps(out + r * out_stride + dim0 + 8, acc[r][1]);
        }
    }
}
#endif
