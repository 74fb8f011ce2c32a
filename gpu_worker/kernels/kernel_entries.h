/* The kernels one C file calls in another: the one-call decoder layers (decoder_layers.c)
 * call the others' entry points. Each defining file includes this too, so the compiler
 * holds caller and definition to one signature. */
#pragma once

#include <stdint.h>

int rms_norm(const void *x, const void *weight, void *out, int dtype, int64_t rows,
             int64_t hidden, float eps);
int add_rms_norm(const void *x, const void *residual, const void *weight, void *sum, void *out,
                 int dtype, int64_t rows, int64_t hidden, float eps);
int gemm_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *packed, int64_t N,
              const uint16_t *bias, uint16_t *y);
int gemm_f32(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
             const float *bias, float *y);
int gemm_f32_silu_mul(const float *x, int64_t M, int64_t K, const float *packed, int64_t N,
                      const float *bias, float *out);
int rotary_inplace(void *x, const void *cos, const void *sin, int dtype, int64_t tokens,
                   int64_t heads, int64_t head_dim, int64_t row_stride);
int write_kv(const void *k_new, const void *v_new, int new_dtype, int64_t k_row_stride,
             int64_t v_row_stride, const int64_t *loc, int64_t tokens, int64_t kv_heads,
             int64_t head_dim, void *k_cache, void *v_cache, int cache_dtype,
             int64_t head_stride, int64_t slot_stride);
int extend_attention(const void *q, int q_dtype, int64_t q_token_stride, const void *k_cache,
                     const void *v_cache, int kv_dtype, int64_t kv_head_stride,
                     int64_t kv_slot_stride, const int64_t *req_to_token, int64_t table_stride,
                     const int64_t *req_pool_indices, const int64_t *prefix_lens,
                     const int64_t *extend_lens, int64_t bs, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, float scale, void *out,
                     int out_dtype);
int paged_decode_attention(const void *q, int q_dtype, int64_t q_stride, const void *k_cache,
                           const void *v_cache, int kv_dtype, int64_t kv_head_stride,
                           int64_t kv_slot_stride, const int64_t *req_to_token,
                           int64_t table_stride, const int64_t *req_pool_indices,
                           const int64_t *seq_lens, int64_t bs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, float scale, int64_t chunk,
                           void *out, int out_dtype);
int silu_and_mul(const void *x, int64_t x_row_stride, void *out, int dtype, int64_t rows,
                 int64_t inter);
