/* The bfloat16 half of extend_attention.c: its kernels for a bfloat16 query and pool on a
 * CPU with AVX512-BF16 (key packing, scores, softmax, P V). Included by extend_attention.c
 * once it has defined KEY_BLOCK and PV_4_ROWS_ALL; every function here is static to it. */
#pragma once

#include "common.h"
#if defined(__AVX512BF16__)
/* bfloat16 queries and pool, with AVX512-BF16's vdpbf16ps: two dimensions per instruction,
 * exact products summed in float32. Keys sit in 32-key blocks of dimension pairs
 * ([head_dim / 2][32][2]), values in key pairs ([keys / 2][head_dim][2]); probabilities are
 * rounded to bfloat16 for P V, as the torch path's bfloat16 matmul does. Scores stay
 * unscaled dot products: the scale goes into the softmax's one FMA per 16 keys.
 *
 * Each row's max over the keys it sees (row r: seen0 + r keys for r < seeing, none after)
 * is folded into top[r][16] as its block's sums are stored, which saves the softmax a pass.
 * top lives in the caller's memory on purpose: kept in registers beside the 16 sums (tried),
 * gcc 12 spilled the key vectors on every dot-product step and the scores took 1.7x as long.
 * Not inlined either: inside the work-item loop gcc spilled a key vector there too. */
/* 8 rows' sums against one key block: both halves (32 keys), or the first 16 alone. */
static inline __attribute__((always_inline)) void score_block_8_rows(
    const uint32_t *qp, int64_t row_pairs, int64_t pairs, const uint16_t *block,
    __m512 acc[8][2], const int HALVES)
{
    for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t dp = 0; dp < pairs; dp++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(block + dp * 2 * KEY_BLOCK);
        const __m512bh k1 = HALVES == 2 ? (__m512bh)_mm512_loadu_si512(block + dp * 2 * KEY_BLOCK + 32) : k0;
        for (int r = 0; r < 8; r++) {
            const __m512bh qd = (__m512bh)_mm512_set1_epi32((int)qp[r * row_pairs + dp]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], k0, qd);
            if (HALVES == 2) acc[r][1] = _mm512_dpbf16_ps(acc[r][1], k1, qd);
        }
    }
}

__attribute__((noinline)) static void scores_8_rows_bf16(const uint16_t *q, int64_t q_stride,
                                                         int64_t head_dim, const uint16_t *kp,
                                                         int64_t keys, float *scores,
                                                         int64_t score_stride, int64_t seen0,
                                                         int64_t seeing, float *top) {
    const uint32_t *qp = (const uint32_t *)q; /* a (d, d + 1) pair per element */
    const int64_t pairs = head_dim / 2, row_pairs = q_stride / 2;
    for (int64_t kb = 0; kb * KEY_BLOCK < keys; kb++) {
        const uint16_t *block = kp + kb * head_dim * KEY_BLOCK;
        __m512 acc[8][2];
        /* A last block of 16 keys or fewer: its second half's sums stay zeros that no row
         * reads (the softmax stops at the keys' even count). */
        if (keys - kb * KEY_BLOCK > 16) score_block_8_rows(qp, row_pairs, pairs, block, acc, 2);
        else score_block_8_rows(qp, row_pairs, pairs, block, acc, 1);
        for (int r = 0; r < 8; r++) {
            float *dst = scores + r * score_stride + kb * KEY_BLOCK;
            _mm512_storeu_ps(dst, acc[r][0]);
            _mm512_storeu_ps(dst + 16, acc[r][1]);
            const int64_t valid = r < seeing ? seen0 + r - kb * KEY_BLOCK : 0;
            const uint32_t mask = valid >= KEY_BLOCK ? ~0u : valid <= 0 ? 0u : (1u << valid) - 1;
            __m512 most = _mm512_loadu_ps(top + 16 * r);
            most = _mm512_mask_max_ps(most, (__mmask16)mask, most, acc[r][0]);
            _mm512_storeu_ps(top + 16 * r, _mm512_mask_max_ps(most, (__mmask16)(mask >> 16), most, acc[r][1]));
        }
    }
}

/* 2^t for t <= 0: n = round(t), 2^(t - n) by a degree-4 polynomial fitted for least
 * relative error on [-1/2, 1/2] (2.7e-6 in float32), scaled by 2^n. What it feeds is P
 * rounded to bfloat16 (a relative 2^-9 at worst) and a float32 sum: Cephes' degree 6
 * (1e-7) bought nothing there and cost two FMAs of the ~12 operations per 16 keys, and the
 * softmax was 14% of a bfloat16 prefill chunk's attention on AMD Zen 4 (~30% on a Xeon's
 * tiles). Working in base 2 saves exp_nonpositive's multiply by log2(e). */
static inline __m512 exp2_nonpositive(__m512 t) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-126.f)); /* 2^-126 is 0 to float32 softmax */
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(9.5718065e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5918004e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4024703e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9312179e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.99999928f));
    return _mm512_scalef_ps(p, n);
}

/* 2^(c s - shift) for 16 scores from s. */
static inline __attribute__((always_inline)) __m512 numerators_16(const float *s, __m512 vc,
                                                                  __m512 shift) {
    return exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s), vc, shift));
}

/* p[j] = bfloat16 of exp(scale * (s[j] - max)) for j < seen, 0 from seen to `end` (even, at
 * most the row's computed keys): one pass that reads the scores, exponentiates, sums in
 * float32 and writes P. Returns the sum (0 for a row that sees nothing). The keys a row sees
 * go 32 at a time with no masks (two chains in flight, two sums, one vcvtne2ps2bf16 and one
 * store for both); the masked loop takes the rest: the mask arithmetic on every 16 keys had
 * been a third of the loop's instructions. */
static float softmax_numerators_bf16(const float *s, int64_t seen, int64_t end, float max,
                                     float scale, uint16_t *p) {
    const float c = scale * 1.44269504088896341f; /* exp(scale x) = 2^(c x) */
    const __m512 vc = _mm512_set1_ps(c), shift = _mm512_set1_ps(seen ? max * c : 0.f);
    __m512 total = _mm512_setzero_ps(), total1 = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= seen; j += 32) {
        const __m512 e0 = numerators_16(s + j, vc, shift), e1 = numerators_16(s + j + 16, vc, shift);
        total = _mm512_add_ps(total, e0), total1 = _mm512_add_ps(total1, e1);
        _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)); /* e0 low */
    }
    for (; j < end; j += 16) {
        int64_t valid = seen - j, width = end - j;
        valid = valid < 0 ? 0 : valid > 16 ? 16 : valid;
        width = width > 16 ? 16 : width;
        const __mmask16 live = (__mmask16)((1u << valid) - 1);
        const __m512 e = numerators_16(s + j, vc, shift);
        total = _mm512_mask_add_ps(total, live, total, e);
        _mm256_mask_storeu_epi16(p + j, (__mmask16)((1u << width) - 1),
                                 (__m256i)_mm512_maskz_cvtneps_pbh(live, e));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(total, total1));
}

/* 16 x 16 32-bit words transposed in registers: r[i] lane j becomes r[j] lane i. */
static inline void transpose_16x16_epi32(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    }
}

/* One request's keys (slots[0 .. keys) of the head's pool rows) into 32-key blocks of
 * dimension pairs, zeros up to `padded` keys: 16 keys x 16 pairs at a time through a
 * register transpose. Storing each key's pairs one by one, 32 words on 32 cache lines per
 * key, was 6% of a prefill chunk's attention. */
static void pack_keys_bf16(const uint16_t *k_head, int64_t slot_stride, const int64_t *slots,
                           int64_t keys, int64_t padded, int64_t head_dim, uint16_t *kp) {
    const int64_t pairs = head_dim / 2;
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
        uint32_t *block = (uint32_t *)(kp + (j0 / KEY_BLOCK) * head_dim * KEY_BLOCK) + j0 % KEY_BLOCK;
        for (int64_t dp0 = 0; dp0 < pairs; dp0 += 16) {
            const int64_t width = pairs - dp0 < 16 ? pairs - dp0 : 16;
            const __mmask16 columns = (__mmask16)((1u << width) - 1);
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = j0 + i < keys
                           ? _mm512_maskz_loadu_epi32(columns, k_head + slots[j0 + i] * slot_stride + 2 * dp0)
                           : _mm512_setzero_si512();
            transpose_16x16_epi32(r);
            for (int64_t d = 0; d < width; d++) _mm512_storeu_si512(block + (dp0 + d) * KEY_BLOCK, r[d]);
        }
    }
}

static inline __attribute__((always_inline)) void pv_4_rows_bf16(
    const uint16_t *p, int64_t p_stride, const uint16_t *vp, int64_t head_dim, int64_t keys,
    int64_t dim0, float *out, int64_t out_stride, const int WIDTH)
{
    __m512 acc[4][4];
    __m512bh vj[4];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < WIDTH; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t jp = 0; jp < (keys + 1) / 2; jp++) {
        for (int i = 0; i < WIDTH; i++)
            vj[i] = (__m512bh)_mm512_loadu_si512(vp + (jp * head_dim + dim0 + 16 * i) * 2);
        for (int r = 0; r < 4; r++) {
            const uint32_t pair = ((const uint32_t *)(p + r * p_stride))[jp];
            const __m512bh pj = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int i = 0; i < WIDTH; i++) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], vj[i], pj);
        }
    }
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < WIDTH; i++) _mm512_storeu_ps(out + r * out_stride + 16 * i, acc[r][i]);
}

static void pv_4_rows_all_bf16(const uint16_t *p, int64_t p_stride, const uint16_t *vp,
                               int64_t head_dim, int64_t keys, float *out, int64_t out_stride) {
    PV_4_ROWS_ALL(pv_4_rows_bf16, p, p_stride, vp, head_dim, keys, out, out_stride);
}
#endif
