/* A bfloat16 matmul of any row count, made for those a decode step has: y[M, N] = x[M, K]
 * W^T (+ bias), on AVX512-BF16 (vdpbf16ps), float32 accumulation, y rounded to bfloat16 once.
 *
 * Why not oneDNN's: on SmolLM2's shapes (K = 576 or 1536), with 30 layers' weights coming
 * from DRAM on two Zen 4 cores, oneDNN's packed GEMM ran at 143-354 GFLOPS for 8-64 rows
 * and this loop at 222-422 (1.2-1.55x; 1.1x at 256 rows, even at 2048): a micro-tile of
 * 6 rows x 64 columns keeps 24 accumulators in registers, and each pair of k costs four
 * weight loads, six broadcasts of x and 24 vdpbf16ps, so the FMA port, not the loads,
 * sets the pace.
 *
 * The weight is packed once (gemm_bf16_pack) into panels of 64 columns, each k pair's 64
 * columns x 2 values side by side: the operand layout vdpbf16ps reads, streamed in order.
 * Work items are (panel, 6-row block) pairs split evenly over the threads, panel-major, so
 * each thread streams its own run of panels from memory once and reuses each from L2.
 * Shapes it does not take (N not a multiple of 64, K odd, a CPU without AVX512-BF16)
 * return -1: the caller keeps oneDNN.
 */
#include "common.h"
#include "kernel_entries.h"

#define GEMM_NR 64 /* columns of a panel and a micro-tile: four zmm of accumulators a row */
#define GEMM_MR 6  /* rows of a micro-tile: 6 x 4 = 24 accumulators */

int gemm_bf16_supported(int64_t N, int64_t K) {
#if defined(__AVX512BF16__)
    return N > 0 && K > 0 && N % GEMM_NR == 0 && K % 2 == 0;
#else
    (void)N, (void)K;
    return 0;
#endif
}

/* w[N, K] bfloat16 -> packed[N / 64][K / 2][64][2]. */
int gemm_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint16_t *packed) {
    if (!gemm_bf16_supported(N, K)) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < N / GEMM_NR; p++)
        for (int64_t kp = 0; kp < K / 2; kp++) {
            uint16_t *dst = packed + (p * (K / 2) + kp) * GEMM_NR * 2;
            for (int64_t c = 0; c < GEMM_NR; c++) {
                const uint16_t *src = w + (p * GEMM_NR + c) * K + 2 * kp;
                dst[2 * c] = src[0];
                dst[2 * c + 1] = src[1];
            }
        }
    return 0;
}

#if defined(__AVX512BF16__)
/* R rows of x (row length K) against one panel: the 64 sums of each row into acc[r * 64]. */
#define GEMM_TILE(R)                                                                        \
    static void gemm_tile_##R(const uint16_t *x, int64_t K, const uint16_t *panel,         \
                              float *acc_out) {                                             \
        __m512 acc[R][4];                                                                   \
        for (int r = 0; r < R; r++)                                                         \
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();                    \
        const int32_t *pairs = (const int32_t *)x; /* x's k pairs, one int32 each */        \
        for (int64_t kp = 0; kp < K / 2; kp++) {                                            \
            const __m512bh *w = (const __m512bh *)(panel + kp * GEMM_NR * 2);               \
            const __m512bh w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];                      \
            for (int r = 0; r < R; r++) {                                                   \
                const __m512bh b = (__m512bh)_mm512_set1_epi32(pairs[r * (K / 2) + kp]);   \
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);                             \
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);                             \
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], b, w2);                             \
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], b, w3);                             \
            }                                                                               \
        }                                                                                   \
        for (int r = 0; r < R; r++)                                                         \
            for (int j = 0; j < 4; j++)                                                     \
                _mm512_storeu_ps(acc_out + r * GEMM_NR + 16 * j, acc[r][j]);                \
    }
EACH_TILE_ROWS(GEMM_TILE)
#endif

/* y[M, N] bfloat16 = x[M, K] bfloat16 (contiguous) @ W^T + bias[N] (bfloat16, or NULL), W
 * packed by gemm_bf16_pack. */
int gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
              const uint16_t *bias, uint16_t *y) {
    if (M < 1 || !gemm_bf16_supported(N, K)) return -1;
#if defined(__AVX512BF16__)
    const int64_t blocks = (M + GEMM_MR - 1) / GEMM_MR;
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < N / GEMM_NR * blocks; item++) {
        const int64_t p = item / blocks, m0 = item % blocks * GEMM_MR;
        const int64_t rows = M - m0 < GEMM_MR ? M - m0 : GEMM_MR;
        const uint16_t *panel = packed + p * (K / 2) * GEMM_NR * 2, *xr = x + m0 * K;
        float acc[GEMM_MR * GEMM_NR];
        TILE_OF_ROWS(gemm_tile, rows, xr, K, panel, acc);
        for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < 4; j++) {
                const int64_t n = p * GEMM_NR + 16 * j;
                __m512 sum = _mm512_loadu_ps(acc + r * GEMM_NR + 16 * j);
                if (bias) sum = _mm512_add_ps(sum, load16(bias, DT_BF16, n));
                _mm256_storeu_si256((__m256i *)(y + (m0 + r) * N + n), f32_to_bf16_16(sum));
            }
    }
    return 0;
#else
    (void)x, (void)packed, (void)bias, (void)y;
    return -1;
#endif
}
