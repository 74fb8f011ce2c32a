/* The float32 products of extend_attention.c on a CPU with AVX2 and FMA but no AVX-512
 * (AMD Zen 2/3, Intel before Skylake-X): the same layouts and contracts as its AVX-512
 * scores_8_rows and pv_4_rows_all, in 8-float registers. Included by extend_attention.c once
 * it has defined KEY_BLOCK; every function here is static to it.
 *
 * A tile is 2 rows x 32 columns: 8 accumulators (as many as two FMA pipes of latency 4 keep
 * busy), four operand vectors and a broadcast, in 16 ymm registers. Rows cost broadcasts,
 * which are what limits here: on AMD Zen 3 a 4 x 16 tile (also 8 accumulators, four
 * broadcasts and two vectors a step) ran a 512-key score loop at 45-50 GFLOPS on one core,
 * 2 x 32 at 62-81, of the 97 its two FMA pipes give. */
#pragma once

#include "common.h"
#if defined(HAVE_AVX2_FMA) && !defined(__AVX512F__)

/* Keeps a loaded vector in its register: gcc 12 otherwise folds the load into each FMA that
 * reads it, loading it again per row (10 loads for 8 FMAs where 6 do). */
#define IN_REGISTER(x) __asm__("" : "+x"(x))

/* scores[r][0 .. keys) = q_r . k for 8 rows of q (float32 [8][head_dim], pre-scaled) against
 * the transposed key blocks kt ([blocks][head_dim][KEY_BLOCK]); columns from `keys` up to
 * the block's end hold padding sums that no row reads. */
static void scores_8_rows(const float *q, int64_t head_dim, const float *kt, int64_t keys,
                          float *scores, int64_t score_stride) {
    _Static_assert(KEY_BLOCK == 32, "a tile's 4 vectors are one key block's row");
    for (int64_t kb = 0; kb * KEY_BLOCK < keys; kb++) {
        const float *block = kt + kb * head_dim * KEY_BLOCK;
        for (int r0 = 0; r0 < 8; r0 += 2) {
            const float *q0 = q + r0 * head_dim, *q1 = q0 + head_dim;
            __m256 acc[2][4];
            for (int c = 0; c < 4; c++) acc[0][c] = acc[1][c] = _mm256_setzero_ps();
            for (int64_t d = 0; d < head_dim; d++) {
                __m256 k[4];
                for (int c = 0; c < 4; c++) {
                    k[c] = _mm256_loadu_ps(block + d * KEY_BLOCK + 8 * c);
                    IN_REGISTER(k[c]);
                }
                const __m256 a = _mm256_broadcast_ss(q0 + d), b = _mm256_broadcast_ss(q1 + d);
                for (int c = 0; c < 4; c++) {
                    acc[0][c] = _mm256_fmadd_ps(a, k[c], acc[0][c]);
                    acc[1][c] = _mm256_fmadd_ps(b, k[c], acc[1][c]);
                }
            }
            for (int r = 0; r < 2; r++)
                for (int c = 0; c < 4; c++)
                    _mm256_storeu_ps(scores + (r0 + r) * score_stride + kb * KEY_BLOCK + 8 * c,
                                     acc[r][c]);
        }
    }
}

/* out_r = sum_j p_r[j] v_j for 2 rows of probabilities (zero past each row's keys), over the
 * 8 * WIDTH dimensions from `dim0` of the float32 values [keys][head_dim]. */
static inline __attribute__((always_inline)) void pv_2_rows(
    const float *p, int64_t p_stride, const float *v, int64_t head_dim, int64_t keys,
    int64_t dim0, float *out, int64_t out_stride, const int WIDTH)
{
    __m256 acc[2][4];
    for (int i = 0; i < WIDTH; i++) acc[0][i] = acc[1][i] = _mm256_setzero_ps();
    for (int64_t j = 0; j < keys; j++) {
        __m256 vj[4];
        for (int i = 0; i < WIDTH; i++) {
            vj[i] = _mm256_loadu_ps(v + j * head_dim + dim0 + 8 * i);
            IN_REGISTER(vj[i]);
        }
        const __m256 a = _mm256_broadcast_ss(p + j), b = _mm256_broadcast_ss(p + p_stride + j);
        for (int i = 0; i < WIDTH; i++) {
            acc[0][i] = _mm256_fmadd_ps(a, vj[i], acc[0][i]);
            acc[1][i] = _mm256_fmadd_ps(b, vj[i], acc[1][i]);
        }
    }
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < WIDTH; i++) _mm256_storeu_ps(out + r * out_stride + 8 * i, acc[r][i]);
}

/* The same for 4 rows over every dimension (head_dim a multiple of 16): 32 at a time, then a
 * last 16. */
static void pv_4_rows_all(const float *p, int64_t p_stride, const float *v, int64_t head_dim,
                          int64_t keys, float *out, int64_t out_stride) {
    for (int64_t r = 0; r < 4; r += 2) {
        const float *pr = p + r * p_stride;
        float *o = out + r * out_stride;
        int64_t dim0 = 0;
        for (; dim0 + 32 <= head_dim; dim0 += 32)
            pv_2_rows(pr, p_stride, v, head_dim, keys, dim0, o + dim0, out_stride, 4);
        if (dim0 < head_dim)
            pv_2_rows(pr, p_stride, v, head_dim, keys, dim0, o + dim0, out_stride, 2);
    }
}
#endif
