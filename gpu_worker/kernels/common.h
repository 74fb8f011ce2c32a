/* What the CPU kernels share: dtype codes, bfloat16 <-> float32, row loads and stores, a dot
 * product (built into one library by cpu_kernels.py with -march=native).
 *
 * Every kernel takes raw pointers with explicit strides and a dtype code per operand,
 * accumulates in float32, and writes float32 or bfloat16 (rounded to nearest even, as
 * torch's .to() does). Threads come from OpenMP: the library links libgomp.so.1 by soname,
 * so in a process where torch has loaded its own libgomp this resolves to the same runtime
 * and thread pool.
 */
#pragma once

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
/* 256-bit vectors with FMA (every x86 CPU since 2013-15): the float32 kernels' fallback
 * where there is no AVX-512. */
#define HAVE_AVX2_FMA 1
#endif
#if defined(__AVX512F__) || defined(HAVE_AVX2_FMA)
#include <immintrin.h>
#endif

#if defined(HAVE_AVX2_FMA)
/* The sum and the largest of 8 lanes. */
static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
#endif

enum { DT_F32 = 0, DT_BF16 = 1 };

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* Round a float32 to the nearest bfloat16 and back: what a torch op in bfloat16 stores. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* n elements starting at element `offset` of `base`, as float32 (auto-vectorized). */
static inline void load_f32(const void *base, int dtype, int64_t offset, int64_t n, float *dst) {
    if (dtype == DT_F32) {
        memcpy(dst, (const float *)base + offset, (size_t)n * sizeof(float));
    } else {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

static inline void store_f32(void *base, int dtype, int64_t offset, int64_t n, const float *src) {
    if (dtype == DT_F32) {
        memcpy((float *)base + offset, src, (size_t)n * sizeof(float));
    } else {
        uint16_t *dst = (uint16_t *)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    }
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float sum = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    /* A tree reduction at the end: `omp simd reduction` compiled to 16 serial adds here. */
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    sum = _mm512_reduce_add_ps(acc);
#elif defined(HAVE_AVX2_FMA)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    sum = hsum8(acc);
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#if defined(__AVX512F__)
/* exp(x) for x <= 0 (scores minus their max): 2^n * e^r with n = round(x / ln 2) and
 * |r| <= ln(2) / 2, e^r by its Taylor series to degree 7 (truncation < 6e-9, below float32's
 * rounding). libm's expf is scalar: on a decode step it cost more than reading the keys. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f)); /* exp(-87) is 0 to float32 softmax */
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182f), x);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#elif defined(HAVE_AVX2_FMA)
/* The same for 8 lanes; 2^n goes into the exponent field (n >= -126 after the clamp, so the
 * power stays a normal number). */
static inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147182f), x);
    static const float taylor[8] = {1.f / 5040, 1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};
    __m256 p = _mm256_set1_ps(taylor[0]);
    for (int k = 1; k < 8; k++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(taylor[k]));
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

#endif

#if defined(__AVX512F__)
/* 16 elements from element `offset` of `base` as float32. */
static inline __m512 load16(const void *base, int dtype, int64_t offset) {
    if (dtype == DT_F32) return _mm512_loadu_ps((const float *)base + offset);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#elif defined(HAVE_AVX2_FMA)
/* 8 elements from element `offset` of `base` as float32. */
static inline __m256 load8(const void *base, int dtype, int64_t offset) {
    if (dtype == DT_F32) return _mm256_loadu_ps((const float *)base + offset);
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + offset));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512F__)
/* 16 floats to bfloat16, rounded to nearest even as f32_to_bf16 (quiet NaNs stay NaN).
 * With AVX512-BF16 one instruction does it, where the integer ops took a third of the
 * bfloat16 SiLU-and-mul's time and half of RMSNorm's and rotary's (one thread, 2048 rows of
 * SmolLM2: 2.9 -> 2.0, 0.40 -> 0.29 and 0.67 -> 0.40 ms). It reads a float32 denormal as
 * zero, which no activation these kernels see holds in practice. */
static inline __m256i f32_to_bf16_16(__m512 x) {
#if defined(__AVX512BF16__)
    return (__m256i)_mm512_cvtneps_pbh(x);
#endif
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

/* 16 bfloat16 as float32. */
static inline __m512 widen_bf16_16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 floats stored from element `offset` of `base` in its dtype (bfloat16 rounded). */
static inline void store16(void *base, int dtype, int64_t offset, __m512 x) {
    if (dtype == DT_F32)
        _mm512_storeu_ps((float *)base + offset, x);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)base + offset), f32_to_bf16_16(x));
}

/* x rounded to bfloat16 and back: what a bfloat16 torch op stores, as float32. */
static inline __m512 round_to_bf16_16(__m512 x) { return widen_bf16_16(f32_to_bf16_16(x)); }
#endif

/* The micro-tiles (the GEMMs', float32 extend attention's on AVX2) are compiled for each
 * constant row count, 1 to 6, so that their accumulators stay in registers:
 * EACH_TILE_ROWS(DEFINE) defines them, and TILE_OF_ROWS calls tile_R(...) for R = rows (6
 * for more). Their loops over the accumulators are UNROLLED in full: where gcc left one
 * rolled it kept them on the stack, a store per FMA pair, and gemm_f32 ran at 60 GFLOPS in
 * place of 170 (seen when its k-block size became a variable). */
#define UNROLLED _Pragma("GCC unroll 8")

#if defined(HAVE_AVX2_FMA)
/* The float32 6 x 16 micro-tile's loop in ymm registers (gemm_f32, and extend attention on
 * AVX2): acc[r][0 .. 2) += sum over k < n of a[r * a_stride + k] times the 16 floats at
 * b + k * b_stride, for R rows. The two b vectors are held in registers: gcc would fold their
 * loads into every FMA that reads them, loading them again per row. Where `ahead` is not
 * NULL, each k also asks for the line at ahead + k * b_stride, into L2: the next b a caller
 * will read, on its way while these FMAs run (into L1 it evicted the b being read: 5-9%
 * slower in gemm_f32 once its blocks outgrew L1). */
#define FMA_TILE_16(R, acc, a, a_stride, b, b_stride, n, ahead)                             \
    for (int64_t k_ = 0; k_ < (n); k_++) {                                                  \
        if (ahead) /* NULL where a caller asks for nothing: gcc drops the branch */         \
            _mm_prefetch((const char *)((const float *)(ahead) + k_ * (b_stride)), _MM_HINT_T1); \
        __m256 b0_ = _mm256_loadu_ps((b) + k_ * (b_stride));                                \
        __m256 b1_ = _mm256_loadu_ps((b) + k_ * (b_stride) + 8);                            \
        __asm__("" : "+x"(b0_), "+x"(b1_));                                                 \
        UNROLLED for (int r_ = 0; r_ < (R); r_++) {                                         \
            const __m256 x_ = _mm256_broadcast_ss((a) + r_ * (a_stride) + k_);              \
            acc[r_][0] = _mm256_fmadd_ps(x_, b0_, acc[r_][0]);                              \
            acc[r_][1] = _mm256_fmadd_ps(x_, b1_, acc[r_][1]);                              \
        }                                                                                   \
    }
#endif
#define EACH_TILE_ROWS(DEFINE) DEFINE(1) DEFINE(2) DEFINE(3) DEFINE(4) DEFINE(5) DEFINE(6)
#define TILE_OF_ROWS(tile, rows, ...)                        \
    switch (rows) {                                          \
        case 1: tile##_1(__VA_ARGS__); break;                \
        case 2: tile##_2(__VA_ARGS__); break;                \
        case 3: tile##_3(__VA_ARGS__); break;                \
        case 4: tile##_4(__VA_ARGS__); break;                \
        case 5: tile##_5(__VA_ARGS__); break;                \
        default: tile##_6(__VA_ARGS__); break;               \
    }

/* The largest of s[0..n) (-inf for n = 0). */
static inline float max_f32(const float *s, int64_t n) {
    float m = -INFINITY;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= n; j += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
    m = _mm512_reduce_max_ps(top);
#elif defined(HAVE_AVX2_FMA)
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
    m = hmax8(top);
#endif
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* s[0..n) = exp(s - m) in place; returns their sum. */
static inline float exp_shifted_sum(float *s, int64_t n, float m) {
    float sum = 0.f;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 total = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
        const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), _mm512_set1_ps(m)));
        _mm512_storeu_ps(s + j, e);
        total = _mm512_add_ps(total, e);
    }
    sum = _mm512_reduce_add_ps(total);
#elif defined(HAVE_AVX2_FMA)
    const __m256 shift = _mm256_set1_ps(m);
    __m256 total = _mm256_setzero_ps(), e;
    for (; j + 8 <= n; j += 8, total = _mm256_add_ps(total, e))
        _mm256_storeu_ps(s + j, e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift)));
    sum = hsum8(total);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}
