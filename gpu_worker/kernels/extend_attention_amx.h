/* The AMX half of extend_attention.c: a bfloat16 work item's two products (Q K^T and P V)
 * on AMX tiles where the CPU has them (Sapphire Rapids and later). Included by
 * extend_attention.c after extend_attention_bf16.h, whose key and value packing, softmax
 * and output rounding it shares; every function here is static to it.
 *
 * Why: on an AMX host the prefill's matmuls run on AMX through oneDNN, and the vdpbf16ps
 * products of the AVX512-BF16 path became most of the prefill's time outside them (a Xeon
 * with AMX, 2 cores, mixed-64's prefill: attention 2.0 s of 2.7 s outside 2.6 s of
 * matmuls). A tile product is 16 x 16 x 32 multiply-adds in one instruction, 16 times
 * vdpbf16ps's work.
 *
 * The layouts are the bfloat16 path's, which are already what a tile product reads: a
 * 32-key block of keys ([head_dim / 2][32][2]) is two B tiles of 16 dimension pairs x 16
 * keys, values in key pairs ([keys / 2][head_dim][2]) are B tiles of 16 key pairs x 16
 * dimensions. A work item is 16 new queries of one request and kv head (not 8: a tile has
 * 16 rows), each query head of the group one 16-row tile.
 *
 * The tile instructions sit behind four macros so that a build with
 * -DSTREAMSERVE_EMULATE_AMX runs this same code on any AVX512-BF16 CPU with the tiles as
 * thread-local arrays and each instruction done in C, which is how the suite checks the
 * indexing on machines without AMX (a slow build, for tests only). */
#pragma once

#include "common.h"

#define AMX_QUERY_BLOCK 16 /* rows of a tile */
#define AMX_KEY_STEP 32    /* bfloat16 elements in a tile row (64 bytes) */

#if defined(__AVX512BF16__) && defined(STREAMSERVE_EMULATE_AMX)
#define HAVE_AMX 1
static __thread uint8_t emulated_tiles[8][16][64];
static void emulated_load(int t, const void *base, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy(emulated_tiles[t][r], (const char *)base + r * stride, 64);
}
static void emulated_store(int t, void *base, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy((char *)base + r * stride, emulated_tiles[t][r], 64);
}
/* TDPBF16PS: C[m][n] += A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] over the 16 pairs k.
 * STREAMSERVE_EMULATE_AMX_FAULT drops the last pair: a wrong tile, for the test of the
 * start-up check that must catch one. */
#if defined(STREAMSERVE_EMULATE_AMX_FAULT)
#define EMULATED_PAIRS 15
#else
#define EMULATED_PAIRS 16
#endif
static void emulated_dp(int c, int a, int b) {
    for (int m = 0; m < 16; m++) {
        float *row = (float *)emulated_tiles[c][m];
        const uint16_t *x = (const uint16_t *)emulated_tiles[a][m];
        for (int n = 0; n < 16; n++) {
            float sum = row[n];
            for (int k = 0; k < EMULATED_PAIRS; k++) {
                const uint16_t *y = (const uint16_t *)emulated_tiles[b][k];
                sum += bf16_to_f32(x[2 * k]) * bf16_to_f32(y[2 * n]) +
                       bf16_to_f32(x[2 * k + 1]) * bf16_to_f32(y[2 * n + 1]);
            }
            row[n] = sum;
        }
    }
}
#define TILE_ZERO(t) memset(emulated_tiles[t], 0, sizeof emulated_tiles[t])
#define TILE_LOAD(t, base, stride) emulated_load(t, base, stride)
#define TILE_STORE(t, base, stride) emulated_store(t, base, stride)
#define TILE_DP(c, a, b) emulated_dp(c, a, b)
static int amx_permitted(void) { return 1; }
static void amx_configure(void) {}
static void amx_release(void) {}

#elif defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)

/* Linux lends a process the 8 KB of tile state only once asked (arch_prctl); without it the
 * first tile instruction faults. Asked once; the answer holds for every thread. */
static int amx_permitted(void) {
    static int state; /* 0 not asked, 1 granted, -1 refused */
    if (__atomic_load_n(&state, __ATOMIC_ACQUIRE) == 0) {
        const long granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                     18 /* XFEATURE_XTILEDATA */);
        __atomic_store_n(&state, granted == 0 ? 1 : -1, __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&state, __ATOMIC_ACQUIRE) == 1;
}

/* Every tile 16 rows of 64 bytes: what each product below loads. Per thread. */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((aligned(64))) config = {.palette = 1};
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = 16;
    _tile_loadconfig(&config);
}
static void amx_release(void) { _tile_release(); }
#endif

#if defined(HAVE_AMX)
/* One 32-key block's scores into tiles 0-1: the queries' k-step `step` (32 dimensions) is
 * in tile `qt`, and the block's keys for it go through tiles 4-5. */
#define SCORE_STEP(qt, step)                                                                   \
    do {                                                                                       \
        TILE_LOAD(4, block + (step) * AMX_KEY_STEP * KEY_BLOCK, KEY_BLOCK * 4);                \
        TILE_LOAD(5, block + (step) * AMX_KEY_STEP * KEY_BLOCK + 32, KEY_BLOCK * 4);           \
        TILE_DP(0, qt, 4);                                                                     \
        TILE_DP(1, qt, 5);                                                                     \
    } while (0)

/* scores[r][0 .. blocks * 32) for the 16 query rows of one head (bfloat16 [16][head_dim])
 * against the packed key blocks, with each row's max over the keys it sees (seen[i])
 * folded into top[i][16] while the block is in L1. Tiles: 0-1 sums, 4-5 keys, and the
 * queries, held in 2, 3, 6 and 7 for the whole call up to 128 dimensions (they were
 * loaded again for every block), loaded per block into 2 past that. */
static void scores_tile_rows(const uint16_t *q, int64_t head_dim, const uint16_t *kp,
                             int64_t blocks, float *scores, int64_t score_stride,
                             const int64_t *seen, float *top) {
    const int64_t steps = head_dim / AMX_KEY_STEP;
    const int held = steps <= 4;
    if (held) {
        TILE_LOAD(2, q, head_dim * 2);
        if (steps > 1) TILE_LOAD(3, q + AMX_KEY_STEP, head_dim * 2);
        if (steps > 2) TILE_LOAD(6, q + 2 * AMX_KEY_STEP, head_dim * 2);
        if (steps > 3) TILE_LOAD(7, q + 3 * AMX_KEY_STEP, head_dim * 2);
    }
    for (int64_t kb = 0; kb < blocks; kb++) {
        const uint16_t *block = kp + kb * head_dim * KEY_BLOCK;
        float *dst = scores + kb * KEY_BLOCK;
        TILE_ZERO(0);
        TILE_ZERO(1);
        if (held) {
            SCORE_STEP(2, 0);
            if (steps > 1) SCORE_STEP(3, 1);
            if (steps > 2) SCORE_STEP(6, 2);
            if (steps > 3) SCORE_STEP(7, 3);
        } else {
            for (int64_t step = 0; step < steps; step++) {
                TILE_LOAD(2, q + step * AMX_KEY_STEP, head_dim * 2);
                SCORE_STEP(2, step);
            }
        }
        TILE_STORE(0, dst, score_stride * 4);
        TILE_STORE(1, dst + 16, score_stride * 4);
        for (int i = 0; i < AMX_QUERY_BLOCK; i++) {
            const int64_t valid = seen[i] - kb * KEY_BLOCK;
            const uint32_t mask = valid >= KEY_BLOCK ? ~0u : valid <= 0 ? 0u : (1u << valid) - 1;
            const float *row = dst + i * score_stride;
            __m512 most = _mm512_loadu_ps(top + 16 * i);
            most = _mm512_mask_max_ps(most, (__mmask16)mask, most, _mm512_loadu_ps(row));
            most = _mm512_mask_max_ps(most, (__mmask16)(mask >> 16), most, _mm512_loadu_ps(row + 16));
            _mm512_storeu_ps(top + 16 * i, most);
        }
    }
}

/* acc[r][0 .. head_dim) = sum_j p[r][j] v_j for 16 rows of bfloat16 probabilities over
 * `keys` (a multiple of 32, zeros past each row's own). Tiles: 0-3 sums of 64 dimensions,
 * 4 probabilities, 5-7 values. */
static void pv_tile_rows(const uint16_t *p, int64_t p_stride, const uint16_t *vp,
                         int64_t head_dim, int64_t keys, float *acc) {
    for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        const int64_t width = head_dim - d0 >= 64 ? 4 : (head_dim - d0) / 16;
        TILE_ZERO(0);
        TILE_ZERO(1);
        TILE_ZERO(2);
        TILE_ZERO(3);
        for (int64_t j0 = 0; j0 < keys; j0 += AMX_KEY_STEP) {
            /* 16 key pairs from j0: rows of head_dim dimensions x 2 */
            const uint16_t *v = vp + (j0 / 2 * head_dim + d0) * 2;
            TILE_LOAD(4, p + j0, p_stride * 2);
            TILE_LOAD(5, v, head_dim * 4);
            TILE_DP(0, 4, 5);
            if (width > 1) {
                TILE_LOAD(6, v + 32, head_dim * 4);
                TILE_DP(1, 4, 6);
            }
            if (width > 2) {
                TILE_LOAD(7, v + 64, head_dim * 4);
                TILE_DP(2, 4, 7);
            }
            if (width > 3) {
                TILE_LOAD(5, v + 96, head_dim * 4);
                TILE_DP(3, 4, 5);
            }
        }
        TILE_STORE(0, acc + d0, head_dim * 4);
        if (width > 1) TILE_STORE(1, acc + d0 + 16, head_dim * 4);
        if (width > 2) TILE_STORE(2, acc + d0 + 32, head_dim * 4);
        if (width > 3) TILE_STORE(3, acc + d0 + 48, head_dim * 4);
    }
}

/* One work item on tiles: `count` new queries of request b from its `first`, kv head h,
 * rows g * 16 + i (query head h * group + g, query i). qb, scores, p16, acc: the thread's
 * buffers for group * 16 rows; inv receives each row's 1 / softmax sum. */
static void attend_item_amx(const uint16_t *q, int64_t q_token_stride, int64_t token,
                            int64_t count, int64_t seen0, const uint16_t *kp,
                            const uint16_t *vp, int64_t h, int64_t group, int64_t head_dim,
                            float scale, int64_t max_keys, uint16_t *qb, float *scores,
                            uint16_t *p16, float *acc, float *inv) {
    const int64_t visible = seen0 + count; /* keys the last query sees */
    const int64_t keys = (visible + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
    int64_t seen[AMX_QUERY_BLOCK];
    for (int64_t i = 0; i < AMX_QUERY_BLOCK; i++) seen[i] = i < count ? seen0 + i + 1 : 0;
    for (int64_t g = 0; g < group; g++) {
        uint16_t *rows = qb + g * AMX_QUERY_BLOCK * head_dim;
        for (int64_t i = 0; i < AMX_QUERY_BLOCK; i++) {
            const uint16_t *src = q + (token + i) * q_token_stride + (h * group + g) * head_dim;
            if (i < count) memcpy(rows + i * head_dim, src, (size_t)head_dim * 2);
            else memset(rows + i * head_dim, 0, (size_t)head_dim * 2);
        }
        float top[AMX_QUERY_BLOCK * 16];
        for (int i = 0; i < AMX_QUERY_BLOCK * 16; i++) top[i] = -INFINITY;
        float *s = scores + g * AMX_QUERY_BLOCK * max_keys;
        scores_tile_rows(rows, head_dim, kp, keys / KEY_BLOCK, s, max_keys, seen, top);
        uint16_t *p = p16 + g * AMX_QUERY_BLOCK * max_keys;
        for (int64_t i = 0; i < AMX_QUERY_BLOCK; i++) {
            const float max = _mm512_reduce_max_ps(_mm512_loadu_ps(top + 16 * i));
            const float sum = softmax_numerators_bf16(s + i * max_keys, seen[i], keys, max,
                                                      scale, p + i * max_keys);
            inv[g * AMX_QUERY_BLOCK + i] = seen[i] ? 1.f / sum : 0.f;
        }
        pv_tile_rows(p, max_keys, vp, head_dim, keys, acc + g * AMX_QUERY_BLOCK * head_dim);
    }
}
#endif
