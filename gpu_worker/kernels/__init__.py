"""Kernels for the engine that PyTorch does not provide in the form a CPU decode step needs.

cpu_kernels.py            loading the C files below at first use, and their Python entry points
kernel_build.py           compiling them into one library, cached per machine
amx_check.py              the start-up check of extend attention on AMX tiles
attention.c               decode attention over the paged pool
extend_attention.c        prefill (extend) attention over the paged pool
extend_attention_bf16.h   its bfloat16 products on AVX512-BF16
extend_attention_amx.h    its bfloat16 products on AMX tiles
extend_attention_avx2.h   its float32 products in AVX2 registers
gemm_bf16.c               bfloat16 matmuls on AVX512-BF16 (oneDNN's weakest at decode's rows)
gemm_f32.c                float32 matmuls, every row count, on AVX2 without AVX-512 (and
                          the MLP's gate_up product with SiLU·mul in its epilogue)
layers.c                  Linear, RMSNorm and rotary
activation.c              SiLU·mul: bfloat16 on AVX-512, float32 on AVX2
silu_avx2.h               its float32 arithmetic, shared with gemm_f32.c's epilogue
sampling.c                greedy argmax and the grammar's token mask
decoder_layers.c          a model's decoder layers in one call of the kernels above
kernel_entries.h          the entry points it calls, one signature for caller and definition
common.h                  what the C files share
"""
