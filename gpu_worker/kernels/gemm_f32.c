/* The float32 matmul of CPUs with AVX2 and FMA but no AVX-512, at every row count:
 * y[M, N] = x[M, K] W^T (+ bias), summed in float32 as every path there is.
 *
 * Why not oneDNN's: on SmolLM2's shapes, two Zen 3 cores, 30 layers' weights, this loop
 * led oneDNN's packed GEMM at every row count measured: 1.1-1.5x at a decode step's 8-64
 * rows (40.2 against 60.1 ms at 8), 1.06-1.08x at 128, 1.08-1.11x at 256-2048 (176 against
 * 161 GFLOPS at 2048, 91% of the FMA peak), and it is level with the few-row kernel at one
 * row and ahead from 4 (benchmarks/bench_gemm.py --dtype float32; benchmarks/NOTES.md, the
 * eleventh and twelfth sessions of 2026-11-29). In minutes when the host's other tenants
 * were busy, oneDNN led at 2048 rows instead (by 5-8%: the thirteenth session), which was
 * this loop's fixed split of panels waiting on the slower core; shared out as threads come
 * free (GEMM_F32_SHARED_FROM_ROWS), it led oneDNN again in such minutes, 1.02-1.26x at
 * 128-2048 rows (the fourteenth), and 1.3-1.8x at 1-64. So Linear keeps no oneDNN copy of
 * float32 weights there.
 *
 * A micro-tile is 6 rows x 16 columns: 12 accumulators, two weight loads and six broadcasts
 * of x per k, which ran at 91-93 GFLOPS a core in L1 (94-96% of the FMA peak). The weight
 * is packed once (gemm_f32_pack) into panels of 16 columns, each k's 16 side by side. For
 * each block of k's and MC rows of x, a thread takes a panel (a fixed run of them at a
 * decode step's rows, the next free pair at a prefill's) and sweeps the rows six at a time,
 * adding into y. A block is the whole K up to 2048 (SmolLM2's 576 and 1536:
 * a panel's block is 36 or 96 KB, from L2): blocks of 256, which kept it in L1, cost a pass
 * over y each and ran 4-5% slower at 512-2048 rows and up to 4% at a decode step's rows in
 * busy minutes (bench_gemm.py --dtype float32 --base 63508e8; in quiet ones, even splits
 * of 192 and 288 had measured level with 256). Each tile asks for its y rows when it starts
 * and stores into them (past the first block, adds into them) when it ends, so the miss on
 * y is hidden behind the tile's FMAs (loading y first left them waiting: ~1.1x slower at
 * 2048 rows). The first tile of a sweep also
 * asks for the next panel's block, a line per k: at a decode step's few rows a sweep is one
 * to eleven tiles, and each panel's first tile had waited on its block from DRAM (30
 * layers: 39.5 -> 34.9 ms at 8 rows, 83.7 -> 72.1 at 32, 138.5 -> 132.3 at 64, level from
 * 128; bench_gemm.py --dtype float32 --base f98986d).
 */
#include "common.h"
#include "kernel_entries.h"
#include "silu_avx2.h"

#define GEMM_F32_NR 16  /* columns of a panel and a tile: two ymm a row */
#define GEMM_F32_MR 6   /* rows of a tile: 6 x 2 = 12 accumulators */
#define GEMM_F32_KC 2048 /* most k's of a block: 2048 x 16 floats, 128 KB of L2 */
#define GEMM_F32_MC 96   /* rows of x a block sweeps */

#if defined(HAVE_AVX2_FMA) && !defined(__AVX512F__)
#define GEMM_F32_BUILT 1
#else
#define GEMM_F32_BUILT 0 /* elsewhere F.linear and the few-row kernel take float32 */
#endif

int gemm_f32_supported(int64_t N, int64_t K) {
    return GEMM_F32_BUILT && N > 0 && K > 0 && N % GEMM_F32_NR == 0;
}

/* w[N, K] float32 -> packed[N / 16][K][16]: row n of w is column n % 16 of panel n / 16. */
int gemm_f32_pack(const float *w, int64_t N, int64_t K, float *packed) {
    if (!gemm_f32_supported(N, K)) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *column = packed + n / GEMM_F32_NR * K * GEMM_F32_NR + n % GEMM_F32_NR;
        for (int64_t k = 0; k < K; k++) column[k * GEMM_F32_NR] = w[n * K + k];
    }
    return 0;
}

#if GEMM_F32_BUILT
/* R rows of x (row stride K) times kc k's of a panel's block, into y's R x 16 (row stride
 * N): y = the sums + start where start is given (the first block: bias or zeros), else
 * y += the sums; a line of the block at `ahead` (NULL: none) is asked for per k. */
#define GEMM_F32_TILE(R)                                                                    \
    static void gemm_f32_tile_##R(const float *x, int64_t K, const float *block, int64_t kc, \
                                  float *y, int64_t N, const float *start,                  \
                                  const float *ahead) {                                     \
        __m256 acc[R][2];                                                                   \
        UNROLLED for (int r = 0; r < R; r++) {                                              \
            _mm_prefetch((const char *)(y + r * N), _MM_HINT_T0);                           \
            acc[r][0] = start ? _mm256_loadu_ps(start) : _mm256_setzero_ps();               \
            acc[r][1] = start ? _mm256_loadu_ps(start + 8) : _mm256_setzero_ps();           \
        }                                                                                   \
        FMA_TILE_16(R, acc, x, K, block, GEMM_F32_NR, kc, ahead);                           \
        UNROLLED for (int r = 0; r < R; r++)                                                \
            UNROLLED for (int j = 0; j < 2; j++) {                                          \
                float *out = y + r * N + 8 * j;                                             \
                _mm256_storeu_ps(out, start ? acc[r][j]                                     \
                                            : _mm256_add_ps(acc[r][j], _mm256_loadu_ps(out))); \
            }                                                                               \
    }
EACH_TILE_ROWS(GEMM_F32_TILE)
#endif

/* From this many rows the panels go to threads as they come free, two at a time; below it
 * each thread takes a fixed run of them. On a shared host one of the two cores is often
 * slower for a while (its other tenants), and a fixed split waits on it: at 2048 rows the
 * dynamic split took 2846-2957 against 3365-3508 ms (30 layers; oneDNN's 3233-3245), at
 * 256 364 against 410, at 128 198 against 230, at 512 822 against 886. At a decode
 * step's 1-8 rows a panel is a tile or two, and taking each pair through a shared counter
 * cost more (36.6 against 30.2 ms at 8 rows), as did losing the next panel's prefetch to
 * the other thread; level at 64 (bench_gemm.py --dtype float32). */
#define GEMM_F32_SHARED_FROM_ROWS 128

/* `sweep` (a statement of p) for each panel p < count, inside a parallel region: the panels
 * go to threads as they come free, two at a time, where `shared`, else in fixed runs (the
 * same run for a thread in every call). No barrier after: the caller knows whether the
 * next call may start. */
#define EACH_PANEL(shared, count, sweep)                                  \
    do {                                                                  \
        if (shared) {                                                     \
            _Pragma("omp for schedule(dynamic, 2) nowait")                \
            for (int64_t p = 0; p < (count); p++) sweep;                  \
        } else {                                                          \
            _Pragma("omp for schedule(static) nowait")                    \
            for (int64_t p = 0; p < (count); p++) sweep;                  \
        }                                                                 \
    } while (0)

#if GEMM_F32_BUILT
static const float gemm_f32_zeros[GEMM_F32_NR]; /* the start of a product without a bias */

/* Panel p's block of k's from k0 (kc of them) times rows m0 .. m0 + mc of x, into y: see
 * gemm_f32. */
static void gemm_f32_sweep(const float *x, int64_t K, const float *packed, int64_t N,
                           int64_t p, int64_t k0, int64_t kc, int64_t m0, int64_t mc,
                           const float *bias, float *y) {
    const float *block = packed + (p * K + k0) * GEMM_F32_NR;
    const float *start = k0 ? NULL : bias ? bias + p * GEMM_F32_NR : gemm_f32_zeros;
    /* The sweep's first tile asks for the next panel's block, a line a k. */
    const float *next = p + 1 < N / GEMM_F32_NR ? block + K * GEMM_F32_NR : NULL;
    for (int64_t i = 0; i < mc; i += GEMM_F32_MR) {
        float *yt = y + (m0 + i) * N + p * GEMM_F32_NR;
        const float *xt = x + (m0 + i) * K + k0;
        const int64_t rows = mc - i < GEMM_F32_MR ? mc - i : GEMM_F32_MR;
        TILE_OF_ROWS(gemm_f32_tile, rows, xt, K, block, kc, yt, N, start, i ? NULL : next);
    }
}
#endif

/* y[M, N] float32 = x[M, K] float32 (contiguous) @ W^T + bias[N] (or NULL), W packed by
 * gemm_f32_pack. */
int gemm_f32(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
             const float *bias, float *y) {
    if (M < 1 || !gemm_f32_supported(N, K)) return -1;
#if GEMM_F32_BUILT
    /* K in equal blocks of at most GEMM_F32_KC: each block is another pass adding into y. */
    const int64_t blocks = (K + GEMM_F32_KC - 1) / GEMM_F32_KC, even = (K + blocks - 1) / blocks;
    /* Past one block a thread must own its columns of y in every block (below). */
    const int shared = blocks == 1 && M >= GEMM_F32_SHARED_FROM_ROWS;
#pragma omp parallel
    for (int64_t k0 = 0; k0 < K; k0 += even) {
        const int64_t kc = K - k0 < even ? K - k0 : even;
        for (int64_t m0 = 0; m0 < M; m0 += GEMM_F32_MC) {
            const int64_t mc = M - m0 < GEMM_F32_MC ? M - m0 : GEMM_F32_MC;
            /* No barrier between blocks: past one, a thread's panels are the same in every
             * block (the fixed runs), so it only ever adds into its own columns of y. */
            EACH_PANEL(shared, N / GEMM_F32_NR,
                       gemm_f32_sweep(x, K, packed, N, p, k0, kc, m0, mc, bias, y));
        }
    }
    return 0;
#else
    (void)x, (void)packed, (void)bias, (void)y;
    return -1;
#endif
}

#if GEMM_F32_BUILT
/* Gate panel p and up panel p + panels times rows m0 .. m0 + mc of x, into out's 16
 * columns from p * 16: see gemm_f32_silu_mul. */
static void gemm_f32_silu_mul_sweep(const float *x, int64_t K, const float *packed,
                                    int64_t panels, int64_t p, int64_t m0, int64_t mc,
                                    const float *bias, float *out) {
    const int64_t half = panels * GEMM_F32_NR;
    const float *gate = packed + p * K * GEMM_F32_NR;
    const float *up = gate + panels * K * GEMM_F32_NR;
    const float *gate_start = bias ? bias + p * GEMM_F32_NR : gemm_f32_zeros;
    const float *up_start = bias ? bias + (p + panels) * GEMM_F32_NR : gemm_f32_zeros;
    const int last = p + 1 == panels;
    for (int64_t i = 0; i < mc; i += GEMM_F32_MR) {
        float gate_sums[GEMM_F32_MR * GEMM_F32_NR] __attribute__((aligned(32)));
        float up_sums[GEMM_F32_MR * GEMM_F32_NR] __attribute__((aligned(32)));
        const float *xt = x + (m0 + i) * K;
        float *dst = out + (m0 + i) * half + p * GEMM_F32_NR;
        const int64_t rows = mc - i < GEMM_F32_MR ? mc - i : GEMM_F32_MR;
        for (int64_t r = 0; r < rows; r++) _mm_prefetch((const char *)(dst + r * half), _MM_HINT_T0);
        /* The sweep's first tiles ask for the next panels' blocks, as gemm_f32's. */
        TILE_OF_ROWS(gemm_f32_tile, rows, xt, K, gate, K, gate_sums, GEMM_F32_NR,
                     gate_start, i || last ? NULL : gate + K * GEMM_F32_NR);
        TILE_OF_ROWS(gemm_f32_tile, rows, xt, K, up, K, up_sums, GEMM_F32_NR, up_start,
                     i || last ? NULL : up + K * GEMM_F32_NR);
        for (int64_t r = 0; r < rows; r++)
            for (int j = 0; j < GEMM_F32_NR; j += 8)
                silu_mul_8_f32(gate_sums + r * GEMM_F32_NR + j,
                               up_sums + r * GEMM_F32_NR + j, dst + r * half + j);
    }
}
#endif

/* out[M, N / 2] float32 = silu(gate) * up, where [gate | up] = x[M, K] @ W^T + bias is the
 * MLP's gate_up product (W packed by gemm_f32_pack; N / 2 a multiple of 16, K one block).
 *
 * Why: gemm_f32 wrote the [M, N] product for silu_and_mul to read back, twice the
 * activation's size, out of cache at a prefill's rows. Here each tile of gate (panel p) is
 * followed by the same rows' tile of up (panel p + N / 32), both into scratch in L1 from
 * the x rows the first left there, and only the activation is stored: the same sums and
 * the same silu_mul_8_f32 as the two calls, so the same bits. -1 where gemm_f32 and
 * silu_and_mul must run instead (K past a block: the activation needs whole sums). */
int gemm_f32_silu_mul(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
                      const float *bias, float *out) {
    const int64_t half = N / 2;
    if (M < 1 || !gemm_f32_supported(N, K) || half % GEMM_F32_NR || K > GEMM_F32_KC) return -1;
#if GEMM_F32_BUILT
    const int64_t panels = half / GEMM_F32_NR; /* of gate; up's follow them */
#pragma omp parallel
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_F32_MC) {
        const int64_t mc = M - m0 < GEMM_F32_MC ? M - m0 : GEMM_F32_MC;
        EACH_PANEL(M >= GEMM_F32_SHARED_FROM_ROWS, panels,
                   gemm_f32_silu_mul_sweep(x, K, packed, panels, p, m0, mc, bias, out));
    }
    return 0;
#else
    (void)x, (void)packed, (void)bias, (void)out, (void)half;
    return -1;
#endif
}
