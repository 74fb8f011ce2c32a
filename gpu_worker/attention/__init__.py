"""Attention backends over the paged KV pool, chosen by name.

base.py                the backend contract
registry.py            backends by name, imported lazily (no CUDA-only import on a CPU host)
layer.py               the attention layer the models use
torch_native.py        plain torch: runs on CPU and on any device (the reference)
cpu_kernel.py          the C kernels of gpu_worker/kernels/ over the paged pool
flashinfer_backend.py  FlashInfer's paged kernels, everything around them checkable on CPU
paged_metadata.py      FlashInfer's page table for a batch, from the engine's own tables
paged_reference.py     attention that reads exactly FlashInfer's page table, in plain torch
"""
