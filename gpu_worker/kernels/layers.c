/* The dense layers' CPU kernels: a linear for a few rows, RMSNorm (with or without the
 * residual add before it), rotary in place (SiLU-and-mul: activation.c).
 *
 * linear_small_m: y = x W^T (+ b) for a few rows of x. Decoding one or a few tokens streams
 * the whole weight from memory for a handful of multiply-adds per element; oneDNN's bf16
 * GEMV reached 8-13 GB/s of this host's ~28 GB/s read bandwidth, while a loop that loads
 * each weight row once and FMAs it into every row of x keeps up with it.
 */
#include "common.h"
#include "kernel_entries.h"

/* What this build's vector paths use (bit 0: AVX-512F, bit 1: AVX512-BF16, bit 2: AVX-512F or
 * AVX2 with FMA): the kernels without them refuse (extend attention without bit 2,
 * silu_and_mul in bfloat16 without bit 0 and in float32 without bit 2) or take their generic
 * loops. */
int kernel_features(void) {
    int features = 0;
#if defined(__AVX512F__)
    features |= 1;
#endif
#if defined(__AVX512BF16__)
    features |= 2;
#endif
#if defined(__AVX512F__) || defined(HAVE_AVX2_FMA)
    features |= 4; /* the float32 extend attention */
#endif
    return features;
}

#define MAX_SMALL_M 8

/* Dot products of one weight row (K elements of dtype w_dtype) with M rows of xf. */
static inline __attribute__((always_inline)) void row_dots(
    const void *w, int w_dtype, int64_t n, int64_t K, const float *xf, const int M, float *dots)
{
    int64_t k = 0;
#if defined(__AVX512F__)
    __m512 acc[MAX_SMALL_M][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
    if (w_dtype == DT_BF16) {
        const uint16_t *wr = (const uint16_t *)w + n * K;
        for (; k + 32 <= K; k += 32) {
            const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wr + k))), 16));
            const __m512 w1 = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(wr + k + 16))), 16));
            for (int m = 0; m < M; m++) {
                acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + m * K + k), acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + m * K + k + 16), acc[m][1]);
            }
        }
    } else {
        const float *wr = (const float *)w + n * K;
        for (; k + 32 <= K; k += 32) {
            const __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + 16);
            for (int m = 0; m < M; m++) {
                acc[m][0] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + m * K + k), acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + m * K + k + 16), acc[m][1]);
            }
        }
    }
    for (int m = 0; m < M; m++) dots[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]));
#elif defined(HAVE_AVX2_FMA)
    /* The same in 8-float registers: the loop over a copied row it replaces read 30 SmolLM2
     * layers' float32 weights at 5 GB/s for one row, and 1 GB/s for eight. */
    __m256 acc[MAX_SMALL_M][2];
    for (int m = 0; m < M; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
        const __m256 w0 = load8(w, w_dtype, n * K + k), w1 = load8(w, w_dtype, n * K + k + 8);
        for (int m = 0; m < M; m++) {
            acc[m][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xf + m * K + k), acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xf + m * K + k + 8), acc[m][1]);
        }
    }
    for (int m = 0; m < M; m++) dots[m] = hsum8(_mm256_add_ps(acc[m][0], acc[m][1]));
#else
    for (int m = 0; m < M; m++) dots[m] = 0.f;
#endif
    if (k < K) { /* the tail, or everything without vector registers (auto-vectorized) */
        float wf[K - k];
        load_f32(w, w_dtype, n * K + k, K - k, wf);
        for (int m = 0; m < M; m++) dots[m] += dot_f32(wf, xf + m * K + k, K - k);
    }
}

#define ROWS(M_)                                                                          \
    _Pragma("omp parallel for schedule(static)")                                          \
    for (int64_t n = 0; n < N; n++) {                                                     \
        float dots[MAX_SMALL_M];                                                          \
        row_dots(w, w_dtype, n, K, xf, M_, dots);                                         \
        const float b = bias ? (bias_dtype == DT_F32 ? ((const float *)bias)[n]           \
                                                     : bf16_to_f32(((const uint16_t *)bias)[n])) \
                             : 0.f;                                                       \
        for (int m = 0; m < M_; m++) yf[m * N + n] = dots[m] + b;                         \
    }

/* y[M, N] = x[M, K] @ w[N, K]^T + bias[N]; all contiguous; 1 <= M <= MAX_SMALL_M. */
int linear_small_m(const void *x, int x_dtype, int64_t M, int64_t K,
                   const void *w, int w_dtype, int64_t N,
                   const void *bias, int bias_dtype, void *y, int y_dtype)
{
    if (M < 1 || M > MAX_SMALL_M) return -1;
    float *xf = malloc((size_t)(M * K) * sizeof(float));
    float *yf = y_dtype == DT_F32 ? (float *)y : malloc((size_t)(M * N) * sizeof(float));
    if (!xf || !yf) {
        free(xf);
        if (yf != y) free(yf);
        return -2;
    }
    load_f32(x, x_dtype, 0, M * K, xf);
    switch (M) { /* a constant M per case lets the compiler keep acc[][] in registers */
        case 1: ROWS(1) break;
        case 2: ROWS(2) break;
        case 3: ROWS(3) break;
        case 4: ROWS(4) break;
        case 5: ROWS(5) break;
        case 6: ROWS(6) break;
        case 7: ROWS(7) break;
        default: ROWS(8) break;
    }
    if (y_dtype != DT_F32) {
#pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < M; m++) store_f32(y, y_dtype, m * N, N, yf + m * N);
        free(yf);
    }
    free(xf);
    return 0;
}

/* ---- RMSNorm and rotary, one pass each ---------------------------------------------------- */

/* The sum of squares of a float32 row. Four partial sums: with one, each FMA waited on the
 * last (36 in a chain for SmolLM2's 576), a quarter of the bfloat16 norm's time. */
static inline float sum_squares(const float *row, int64_t n) {
    float sum = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (; i + 64 <= n; i += 64)
        for (int a = 0; a < 4; a++) {
            const __m512 v = _mm512_loadu_ps(row + i + 16 * a);
            acc[a] = _mm512_fmadd_ps(v, v, acc[a]);
        }
    for (; i + 16 <= n; i += 16) acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(row + i),
                                                          _mm512_loadu_ps(row + i), acc[0]);
    sum = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]),
                                             _mm512_add_ps(acc[2], acc[3])));
#elif defined(HAVE_AVX2_FMA)
    __m256 acc[4]; /* the same in ymm: the scalar chain took a float32 prefill's norms 2x */
    for (int a = 0; a < 4; a++) acc[a] = _mm256_setzero_ps();
    for (; i + 32 <= n; i += 32)
        for (int a = 0; a < 4; a++) {
            const __m256 v = _mm256_loadu_ps(row + i + 8 * a);
            acc[a] = _mm256_fmadd_ps(v, v, acc[a]);
        }
    for (; i + 8 <= n; i += 8)
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(row + i), acc[0]);
    sum = hsum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
#endif
    for (; i < n; i++) sum += row[i] * row[i];
    return sum;
}

/* out[r] = weight * (row / rms(row)) for a float32 `row` and the weight as float32 `wf`, as
 * transformers' LlamaRMSNorm computes it: the normalized row is cast to the dtype before the
 * weight multiply, so bfloat16 rounds where torch does. */
static void norm_row(const float *row, const float *wf, int dtype, int64_t hidden, float eps,
                     void *out, int64_t offset)
{
    const float inv = 1.f / sqrtf(sum_squares(row, hidden) / (float)hidden + eps);
    int64_t i = 0;
#if defined(__AVX512F__)
    /* 16 at a time: the scalar loop's bfloat16 rounding (a branch per element for NaN) kept
     * the compiler from vectorizing it: 0.2 s of a 19k-token prefill, 3x this. */
    const __m512 scale = _mm512_set1_ps(inv);
    for (; i + 16 <= hidden; i += 16) {
        __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(row + i), scale);
        if (dtype == DT_BF16) normed = round_to_bf16_16(normed);
        store16(out, dtype, offset + i, _mm512_mul_ps(_mm512_loadu_ps(wf + i), normed));
    }
#elif defined(HAVE_AVX2_FMA)
    const __m256 scale = _mm256_set1_ps(inv);
    for (; dtype == DT_F32 && i + 8 <= hidden; i += 8) /* bfloat16: the rounding loop below */
        _mm256_storeu_ps((float *)out + offset + i,
                         _mm256_mul_ps(_mm256_loadu_ps(wf + i),
                                       _mm256_mul_ps(_mm256_loadu_ps(row + i), scale)));
#endif
    for (; i < hidden; i++) {
        const float normed = dtype == DT_BF16 ? round_bf16(row[i] * inv) : row[i] * inv;
        const float y = wf[i] * normed;
        store_f32(out, dtype, offset + i, 1, &y);
    }
}

/* Each thread widens the weight to float32 once (`wf`), not once a row. */
int rms_norm(const void *x, const void *weight, void *out, int dtype, int64_t rows,
             int64_t hidden, float eps)
{
#pragma omp parallel if (rows * hidden >= 32768)
    {
        float wf[hidden], row[hidden];
        load_f32(weight, dtype, 0, hidden, wf);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_f32(x, dtype, r * hidden, hidden, row);
            norm_row(row, wf, dtype, hidden, eps, out, r * hidden);
        }
    }
    return 0;
}

/* sum = x + residual (rounded to the dtype, as torch's add stores it) and out = RMSNorm(sum),
 * in one pass: the decoder layer's residual adds before its norms, which on torch read both
 * operands and wrote the sum only for the norm to read it again. sum may be residual and out
 * x: a row is read whole before either is written. */
int add_rms_norm(const void *x, const void *residual, const void *weight, void *sum, void *out,
                 int dtype, int64_t rows, int64_t hidden, float eps)
{
#pragma omp parallel if (rows * hidden >= 32768)
    {
        float wf[hidden], row[hidden];
        load_f32(weight, dtype, 0, hidden, wf);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            const int64_t offset = r * hidden;
            int64_t i = 0;
#if defined(__AVX512F__)
            for (; i + 16 <= hidden; i += 16) {
                const __m512 total = _mm512_add_ps(load16(x, dtype, offset + i),
                                                   load16(residual, dtype, offset + i));
                if (dtype == DT_BF16) {
                    const __m256i stored = f32_to_bf16_16(total);
                    _mm256_storeu_si256((__m256i *)((uint16_t *)sum + offset + i), stored);
                    _mm512_storeu_ps(row + i, widen_bf16_16(stored)); /* the sum as stored */
                } else {
                    _mm512_storeu_ps((float *)sum + offset + i, total);
                    _mm512_storeu_ps(row + i, total);
                }
            }
#elif defined(HAVE_AVX2_FMA)
            for (; dtype == DT_F32 && i + 8 <= hidden; i += 8) {
                const float *xf = (const float *)x + offset, *rf = (const float *)residual + offset;
                const __m256 total = _mm256_add_ps(_mm256_loadu_ps(xf + i), _mm256_loadu_ps(rf + i));
                _mm256_storeu_ps((float *)sum + offset + i, total);
                _mm256_storeu_ps(row + i, total);
            }
#endif
            for (; i < hidden; i++) {
                float a, b;
                load_f32(x, dtype, offset + i, 1, &a);
                load_f32(residual, dtype, offset + i, 1, &b);
                row[i] = dtype == DT_BF16 ? round_bf16(a + b) : a + b;
                store_f32(sum, dtype, offset + i, 1, &row[i]);
            }
            norm_row(row, wf, dtype, hidden, eps, out, offset);
        }
    }
    return 0;
}

/* Neox-style rotary in place on x [tokens, heads, head_dim] (rows of `row_stride` elements):
 * x * cos + rotate_half(x) * sin with cos, sin [tokens, head_dim], rounding each product and
 * the sum to x's dtype as three bfloat16 torch ops would. */
int rotary_inplace(void *x, const void *cos, const void *sin, int dtype, int64_t tokens,
                   int64_t heads, int64_t head_dim, int64_t row_stride)
{
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= 32768)
    for (int64_t t = 0; t < tokens; t++) {
        float c[head_dim], s[head_dim], v[head_dim], o[head_dim];
        load_f32(cos, dtype, t * head_dim, head_dim, c);
        load_f32(sin, dtype, t * head_dim, head_dim, s);
        for (int64_t h = 0; h < heads; h++) {
            const int64_t offset = t * row_stride + h * head_dim;
            int64_t i = 0;
#if defined(__AVX512F__)
            /* 16 at a time from each half, straight from x (the scalar loop's roundings did
             * not vectorize; a float32 copy of the head first cost 11-21% more). */
            if (half % 16 == 0) {
                for (; i < half; i += 16) {
                    const __m512 lo = load16(x, dtype, offset + i);
                    const __m512 hi = load16(x, dtype, offset + i + half);
                    /* rotate_half(x) = [-hi, lo]; bfloat16 rounds each product, then the sum */
                    __m512 a = _mm512_mul_ps(lo, _mm512_loadu_ps(c + i));
                    __m512 b = _mm512_mul_ps(hi, _mm512_loadu_ps(s + i));
                    __m512 a2 = _mm512_mul_ps(hi, _mm512_loadu_ps(c + i + half));
                    __m512 b2 = _mm512_mul_ps(lo, _mm512_loadu_ps(s + i + half));
                    if (dtype == DT_BF16) {
                        a = round_to_bf16_16(a), b = round_to_bf16_16(b);
                        a2 = round_to_bf16_16(a2), b2 = round_to_bf16_16(b2);
                    }
                    store16(x, dtype, offset + i, _mm512_sub_ps(a, b));
                    store16(x, dtype, offset + i + half, _mm512_add_ps(a2, b2));
                }
                continue;
            }
#elif defined(HAVE_AVX2_FMA)
            if (dtype == DT_F32 && half % 8 == 0) { /* the same in ymm, float32 only */
                float *head = (float *)x + offset;
                for (; i < half; i += 8) {
                    const __m256 lo = _mm256_loadu_ps(head + i), hi = _mm256_loadu_ps(head + i + half);
                    _mm256_storeu_ps(head + i, _mm256_sub_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)),
                                                             _mm256_mul_ps(hi, _mm256_loadu_ps(s + i))));
                    _mm256_storeu_ps(head + i + half,
                                     _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + i + half)),
                                                   _mm256_mul_ps(lo, _mm256_loadu_ps(s + i + half))));
                }
                continue;
            }
#endif
            load_f32(x, dtype, offset, head_dim, v);
            for (; i < head_dim; i++) {
                const float rotated = i < half ? -v[i + half] : v[i - half];
                o[i] = dtype == DT_BF16 ? round_bf16(v[i] * c[i]) + round_bf16(rotated * s[i])
                                        : v[i] * c[i] + rotated * s[i];
            }
            store_f32(x, dtype, offset, head_dim, o);
        }
    }
    return 0;
}
