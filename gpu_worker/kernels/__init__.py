"""Kernels for the engine that PyTorch does not provide in the form a CPU decode step needs.

cpu_kernels.py       compiling the C files below at first use, and their Python entry points
attention.c          decode attention over the paged pool
extend_attention.c   prefill (extend) attention over the paged pool
layers.c             Linear and RMSNorm
sampling.c           greedy argmax
common.h             what the C files share
"""
