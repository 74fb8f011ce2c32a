/* SiLU-and-mul, the MLP's activation: out[r] = silu(gate[r]) * up[r] for rows x[r] = [gate |
 * up] (x rows strided), as torch's F.silu then mul_ compute it, in one pass where the two
 * torch ops made two over the [tokens, 2 x intermediate] activations.
 *
 * bfloat16 on AVX-512: silu(g) = g / (1 + exp(-g)) in float32 rounded to bfloat16, then the
 * product rounded again, as torch's two ops round; ~25 ms against torch's 123 per 4096-token
 * SmolLM2 prefill chunk.
 *
 * float32 on AVX2 with FMA (on AVX-512 CPUs too): exp(-g) as 2^n e^r, r = -g - n ln 2 by a
 * two-part ln 2, e^r by its series to degree 7, which is as close to the exact silu as
 * torch's own: on 6.3M products of randn x 6 both are at most 4 ulp from a float64 reference
 * and 0.31 ulp on average, and 96% are bit for bit torch's (the rest one ulp apart, as a
 * reordered matmul sum is). 2048 rows of SmolLM2's 2 x 1536: 1.3-1.4 against torch's 2.3-2.5
 * ms; a mixed-64 prefill on an AVX2-only AMD EPYC spent 0.45-0.54 s in it, where torch's two
 * ops had taken ~1.0 (benchmarks/bench_prefill_profile.py).
 *
 * Both overflow exp(-g) to +inf, and silu to -0, where torch's does. */
#include "common.h"
#include "kernel_entries.h"
#include "silu_avx2.h"

#if defined(__AVX512F__)
/* exp(-g) for any float32 g, as 2^t with t = -g log2(e): n = round(t), 2^(t - n) by a
 * degree-5 polynomial fitted for least relative error on [-1/2, 1/2] (2.3e-7 in float32),
 * scaled by 2^n. t's own rounding adds |t| x 6e-8 (1e-6 at g = -20), far below bfloat16's
 * 2^-9 that SiLU rounds to (0 of 6.3M products differ from torch's at randn x 1-20); this
 * saved 8% of silu_and_mul over exp(x) = 2^n e^r with r = x - n ln 2, and that 10% over
 * exp_nonpositive's degree-7 series. Past t = 128 it is +inf, as expf's is (-inf: NaN). */
static inline __m512 exp_negated(__m512 g) {
    static const float coefficients[6] = { /* highest degree first */
        1.32764713e-3f, 9.67554189e-3f, 5.55071309e-2f, 2.40221202e-1f, 6.93146944e-1f, 1.00000012f,
    };
    const __m512 t = _mm512_max_ps(_mm512_mul_ps(g, _mm512_set1_ps(-1.44269504f)),
                                   _mm512_set1_ps(-150.f)); /* 2^-150 is 0; NaN -> -150 */
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(coefficients[0]);
    for (int k = 1; k < 6; k++) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(coefficients[k]));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX512F__)
/* dst[0 .. 16) for 16 bfloat16 gates and ups: silu rounded to bfloat16, then the product,
 * torch's two roundings. One division, no branches: taking exp(-|g|) and blending the
 * numerator by g's sign (as this did) cost 10% more, and exp(-g)'s overflow gives -0. */
static inline void silu_mul_16_bf16(const uint16_t *gate, const uint16_t *up, uint16_t *dst) {
    const __m512 g = load16(gate, DT_BF16, 0), u = load16(up, DT_BF16, 0);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_negated(g)));
    _mm256_storeu_si256((__m256i *)dst, f32_to_bf16_16(_mm512_mul_ps(round_to_bf16_16(silu), u)));
}
#endif

/* silu(gate) * up for rows of bfloat16 (AVX-512) or float32 (AVX2 with FMA); -1 for a
 * dtype this build has no path for. */
int silu_and_mul(const void *x, int64_t x_row_stride, void *out, int dtype, int64_t rows,
                 int64_t inter)
{
#if !defined(__AVX512F__)
    if (dtype == DT_BF16) return -1;
#endif
#if !defined(HAVE_AVX2_FMA)
    if (dtype == DT_F32) return -1;
#endif
    const int64_t size = dtype == DT_BF16 ? 2 : 4, step = 32 / size; /* a vector: 32 bytes in */
#pragma omp parallel for schedule(static) if (rows * inter >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const char *gate = (const char *)x + r * x_row_stride * size, *up = gate + inter * size;
        char *dst = (char *)out + r * inter * size;
        const int64_t next = r + 1 < rows ? x_row_stride * size : 0; /* bytes to the next row */
        int64_t i = 0;
        for (; i + step <= inter; i += step) {
            /* The next row's line at this column, a line a stream every other step: this
             * pass reads the gate_up matmul's fresh output, which the hardware prefetcher
             * left to memory latency (likely as its streams stop at each 4 KB page, and a
             * row spans 1.5): bfloat16, 2.4 -> 1.5 ms at 2048 rows, one thread; float32, 12
             * fresh 2048-row outputs, 1.58 -> 1.27 ms a call. A line 1 KB ahead in the same
             * row did not help, nor this in the norms (slower there). */
            if ((i * size & 63) == 0 && next) {
                __builtin_prefetch(gate + next + i * size, 0, 3);
                __builtin_prefetch(up + next + i * size, 0, 3);
            }
#if defined(__AVX512F__)
            if (dtype == DT_BF16) {
                silu_mul_16_bf16((const uint16_t *)gate + i, (const uint16_t *)up + i,
                                 (uint16_t *)dst + i);
                continue;
            }
#endif
#if defined(HAVE_AVX2_FMA)
            silu_mul_8_f32((const float *)gate + i, (const float *)up + i, (float *)dst + i);
#endif
        }
        for (; i < inter; i++) {
            if (dtype == DT_F32) {
                const float g = ((const float *)gate)[i];
                ((float *)dst)[i] = g / (1.f + expf(-g)) * ((const float *)up)[i];
                continue;
            }
            const float g = bf16_to_f32(((const uint16_t *)gate)[i]);
            const float u = bf16_to_f32(((const uint16_t *)up)[i]);
            ((uint16_t *)dst)[i] = f32_to_bf16(round_bf16(g / (1.f + expf(-g))) * u);
        }
    }
    return 0;
}
