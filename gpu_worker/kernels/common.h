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

#if defined(__AVX512F__)
#include <immintrin.h>
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
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}
