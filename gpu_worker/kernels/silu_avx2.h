/* SiLU-and-mul of float32 in ymm registers (AVX2 with FMA): what activation.c's float32 pass
 * and gemm_f32.c's gate_up product with the activation in its epilogue both compute, one
 * function so that the two are bit for bit the same. */
#pragma once

#include "common.h"

#if defined(HAVE_AVX2_FMA)
/* exp(-g) for any float32 g, in ymm: +inf past g = -88.7 as expf, NaN for NaN. */
static inline __m256 exp_negated_8(__m256 g) {
    /* x = -g clamped to +-104, past which exp is +inf or 0 (NaN -> 104: g's NaN wins) */
    const __m256 x = _mm256_max_ps(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), g),
                                                 _mm256_set1_ps(104.f)),
                                   _mm256_set1_ps(-104.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* r = x - n ln 2 in two steps: ln 2's high part has 15 bits, so n times it is exact
     * (one step, or 2^(x log2 e) as the bfloat16 path takes it, was up to 26 ulp off) */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-6f), r);
    /* e^r for |r| <= ln 2 / 2 to degree 7: the first term left out is 5e-9 of it */
    static const float inverse_factorials[8] = {
        1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f,
    };
    __m256 p = _mm256_set1_ps(inverse_factorials[0]);
    for (int k = 1; k < 8; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(inverse_factorials[k]));
    /* times 2^n as two powers of two, each a normal float's exponent for |n| <= 151 */
    const __m256i whole = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(whole, 1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 low = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    const __m256 high = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(whole, half), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, low), high);
}
#endif

#if defined(HAVE_AVX2_FMA)
/* dst[0 .. 8) for 8 float32 gates and ups. */
static inline void silu_mul_8_f32(const float *gate, const float *up, float *dst) {
    const __m256 g = _mm256_loadu_ps(gate);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp_negated_8(g)));
    _mm256_storeu_ps(dst, _mm256_mul_ps(silu, _mm256_loadu_ps(up)));
}
#endif
