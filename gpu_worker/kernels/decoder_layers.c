/* A model's decoder layers, all of them, in one call: the same kernels the layer modules
 * call one by one (add_rms_norm, the matmul kernel, rotary_inplace, write_kv, extend or
 * decode attention, silu_and_mul), in the same order on the same values, so the result is
 * bit for bit theirs. bfloat16 on gemm_bf16, or float32 on gemm_f32 (whose gate_up product
 * takes the activation into its epilogue, as the MLP module's does).
 *
 * Why: between two kernels the modules run Python and torch ops (views, splits, fresh
 * output tensors, the attention backend), and each of those starts cold, its code and data
 * pushed out of the caches by the kernel before it: ~100 us a kernel. Timed around the C
 * calls alone, a mixed-64 prefill (19,208 tokens, SmolLM2, two AMD cores) spent 0.30-0.35 s
 * of its 11 s outside them, against 1.1 s in every kernel but the matmuls. Here a forward
 * crosses from Python once, and its intermediates live in buffers the caller allocates once
 * a forward, reused by every layer while they are warm.
 *
 * The caller (gpu_worker/models/fused_layers.py) takes this path only where each module
 * would have called these kernels: weights packed for gemm_bf16 or gemm_f32, no hooks, no
 * tensor parallelism, the attention kernels taking the shape. */
#include <time.h>

#include "common.h"
#include "kernel_entries.h"

/* One layer's weights (the run's dtype; the four matmuls' packed by gemm_bf16_pack or
 * gemm_f32_pack, biases or NULL) and its part of the KV pool. */
typedef struct {
    const void *input_norm, *post_norm;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    void *k_cache, *v_cache;
} LayerWeights;

/* One forward: shapes, the batch's attention metadata, the buffers, the part timers. */
typedef struct {
    int64_t layers, tokens, width, heads, kv_heads, head_dim, inter; /* width: hidden size */
    float eps, scale;
    int dtype;                  /* of the weights, activations and cos/sin: DT_BF16 or DT_F32 */
    int kv_dtype;
    int64_t kv_head_stride, kv_slot_stride;
    const void *cos, *sin;      /* [tokens, head_dim] */
    const int64_t *out_cache_loc;
    const int64_t *req_to_token;
    int64_t table_stride;
    const int64_t *req_pool_indices;
    int64_t bs;
    int decode;                 /* 1: seq_lens and chunk; 0: prefix_lens and extend_lens */
    const int64_t *prefix_lens, *extend_lens, *seq_lens;
    int64_t chunk;
    /* residual [tokens, hidden] holds the embeddings and ends with the last layer's sum;
     * hidden [tokens, hidden] holds each norm's output, then the matmul's after it, which
     * the next norm writes over as it reads (as the modules' in-place norms do: a norm
     * written to another buffer took 1.5-2x as long); it ends with the last MLP's output,
     * not yet added to residual */
    void *residual, *hidden, *qkv_out, *attended, *gate_up_out, *act;
    double *seconds;            /* NULL, or += seconds per part (FUSED_PARTS) */
} LayerRun;

enum { PART_MATMULS, PART_ATTENTION, PART_RMS_NORM, PART_ROTARY, PART_KV_WRITE, PART_SILU, FUSED_PARTS };

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Runs `call` (a kernel returning its status) and adds its time to part `part`; any status
 * but 0 ends the layers with it. */
#define TIMED(part, call)                                                     \
    do {                                                                      \
        const double started_ = run->seconds ? now_seconds() : 0.0;           \
        const int status_ = (call);                                           \
        if (run->seconds) run->seconds[part] += now_seconds() - started_;     \
        if (status_ != 0) return status_;                                     \
    } while (0)

/* y = x @ W^T + bias on the run's matmul kernel. */
static int matmul(const LayerRun *run, const void *x, int64_t K, const void *packed, int64_t N,
                  const void *bias, void *y) {
    if (run->dtype == DT_BF16) return gemm_bf16(x, run->tokens, K, packed, N, bias, y);
    return gemm_f32(x, run->tokens, K, packed, N, bias, y);
}

/* Returns 0; a kernel's status otherwise (-1: the attention kernel does not take the shape,
 * which only the first layer can meet, before it has written anything but the KV pool). */
int decoder_layers(const LayerWeights *weights, const LayerRun *run) {
    const int64_t M = run->tokens, width = run->width, dim = run->head_dim;
    const int64_t q_size = run->heads * dim, kv_size = run->kv_heads * dim;
    const int64_t qkv_width = q_size + 2 * kv_size;
    const int dt = run->dtype;
    const size_t size = dt == DT_BF16 ? sizeof(uint16_t) : sizeof(float);
    const char *k_new = (const char *)run->qkv_out + q_size * size, *v_new = k_new + kv_size * size;
    for (int64_t l = 0; l < run->layers; l++) {
        const LayerWeights *w = weights + l;
        if (l == 0)
            TIMED(PART_RMS_NORM, rms_norm(run->residual, w->input_norm, run->hidden, dt, M, width,
                                          run->eps));
        else
            TIMED(PART_RMS_NORM, add_rms_norm(run->hidden, run->residual, w->input_norm,
                                              run->residual, run->hidden, dt, M, width, run->eps));
        TIMED(PART_MATMULS, matmul(run, run->hidden, width, w->qkv, qkv_width, w->qkv_bias,
                                   run->qkv_out));
        TIMED(PART_ROTARY, rotary_inplace(run->qkv_out, run->cos, run->sin, dt, M,
                                          run->heads + run->kv_heads, dim, qkv_width));
        TIMED(PART_KV_WRITE, write_kv(k_new, v_new, dt, qkv_width, qkv_width, run->out_cache_loc,
                                      M, run->kv_heads, dim, w->k_cache, w->v_cache,
                                      run->kv_dtype, run->kv_head_stride, run->kv_slot_stride));
        if (run->decode)
            TIMED(PART_ATTENTION, paged_decode_attention(
                                      run->qkv_out, dt, qkv_width, w->k_cache, w->v_cache,
                                      run->kv_dtype, run->kv_head_stride, run->kv_slot_stride,
                                      run->req_to_token, run->table_stride,
                                      run->req_pool_indices, run->seq_lens, run->bs, run->heads,
                                      run->kv_heads, dim, run->scale, run->chunk, run->attended,
                                      dt));
        else
            TIMED(PART_ATTENTION, extend_attention(
                                      run->qkv_out, dt, qkv_width, w->k_cache, w->v_cache,
                                      run->kv_dtype, run->kv_head_stride, run->kv_slot_stride,
                                      run->req_to_token, run->table_stride,
                                      run->req_pool_indices, run->prefix_lens, run->extend_lens,
                                      run->bs, run->heads, run->kv_heads, dim, run->scale,
                                      run->attended, dt));
        TIMED(PART_MATMULS, matmul(run, run->attended, q_size, w->o, width, w->o_bias, run->hidden));
        TIMED(PART_RMS_NORM, add_rms_norm(run->hidden, run->residual, w->post_norm, run->residual,
                                          run->hidden, dt, M, width, run->eps));
        /* float32: the activation in gemm_f32's epilogue where it takes the shape, as the
         * MLP module takes it (no pass of its own: it counts with the matmuls); otherwise
         * the product, then the pass. */
        const double started = run->seconds ? now_seconds() : 0.0;
        const int fused = dt == DT_F32 && gemm_f32_silu_mul(run->hidden, M, width, w->gate_up,
                                                            2 * run->inter, w->gate_up_bias,
                                                            run->act) == 0;
        if (fused && run->seconds) run->seconds[PART_MATMULS] += now_seconds() - started;
        if (!fused) {
            TIMED(PART_MATMULS, matmul(run, run->hidden, width, w->gate_up, 2 * run->inter,
                                       w->gate_up_bias, run->gate_up_out));
            TIMED(PART_SILU, silu_and_mul(run->gate_up_out, 2 * run->inter, run->act, dt, M,
                                          run->inter));
        }
        TIMED(PART_MATMULS, matmul(run, run->act, run->inter, w->down, width, w->down_bias,
                                   run->hidden));
    }
    return 0;
}
