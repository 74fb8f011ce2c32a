/* Greedy sampling's argmax over float32 logits rows, one row per thread at a time.
 *
 * torch's argmax over [64, 49152] float32 took 1.5-2.6 ms on this host (5-8 GB/s), about 2%
 * of a 64-request decode step; a vectorized max then a search for its first position reads
 * the 12.6 MB at memory speed. Same answer as torch.argmax: the first position of the
 * maximum, or of the first NaN where a row has one.
 */
#include "common.h"

int argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t row_stride, int64_t *out)
{
#pragma omp parallel for schedule(static) if (rows * cols >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * row_stride;
        float m = -INFINITY;
        int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
        for (int64_t j = 0; j < cols; j++) {
            m = row[j] > m ? row[j] : m;
            nan |= row[j] != row[j];
        }
        int64_t found = 0; /* cols == 0 never reaches here: the caller refuses empty rows */
        if (nan) {
            while (row[found] == row[found]) found++;
        } else {
            while (row[found] != m) found++;
        }
        out[r] = found;
    }
    return 0;
}

/* A grammar's token mask applied to float32 logits rows: every token whose bit is clear in
 * its row's packed mask (bit t of word t / 32) becomes -inf. Row i of the mask belongs to
 * logits row rows[i]. torch has no bit-unpacking op; its shift-and-compare version took
 * 11 ms for 64 rows of 49152 tokens on this host, this reads the mask once and the logits
 * only where a bit is clear.
 */
int apply_token_bitmask(float *x, int64_t row_stride, int64_t cols, const int64_t *rows,
                        const int32_t *mask, int64_t n, int64_t words)
{
#pragma omp parallel for schedule(static) if (n * cols >= 65536)
    for (int64_t i = 0; i < n; i++) {
        float *row = x + rows[i] * row_stride;
        const uint32_t *bits = (const uint32_t *)(mask + i * words);
        for (int64_t w = 0; w < words; w++) {
            uint32_t word = bits[w];
            if (word == 0xffffffffu) continue; /* all 32 allowed: the common case */
            int64_t base = w * 32;
            int64_t end = base + 32 < cols ? base + 32 : cols;
            for (int64_t j = base; j < end; j++) {
                if (!((word >> (j - base)) & 1u)) row[j] = -INFINITY;
            }
        }
    }
    return 0;
}
