"""Every decoder layer of a Llama-family model in one C call, on CPU: bfloat16 on gemm_bf16,
or float32 on gemm_f32.

kernels/decoder_layers.c runs the kernels the layer modules call one by one, in their order
on the same values (bit for bit the modules' output), with no Python between them: each
torch op between two kernels started with cold caches, and a mixed-64 prefill on two AMD
cores spent 0.30-0.35 s of 11 s outside its C calls in bfloat16; in float32 on an AVX2-only
EPYC the one call took what bench_prefill_profile.py counts as "rest" from 0.45 to 0.09 s
of ~32. The layers' intermediates live in a few buffers allocated once a forward.

`run_fused_layers` takes this path only where every module would have called those
kernels, and returns None otherwise (the modules then run as before): bfloat16 weights that
gemm_bf16 multiplies at this row count, or float32 ones on gemm_f32 (AVX2 without
AVX-512), the CPU attention backend with its kernels taking the batch, no tensor
parallelism, and no forward hook or pre-hook on the embedding or on any module of a layer
(a hook must see the module called).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from gpu_worker.model_executor.forward_context import get_forward_context
from gpu_worker.models.layers import PACKED_GEMM_FROM_ROWS, Linear

_ptr, _i64, _int, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_DT_BF16, _DT_F32 = 1, 0
_DTYPE_CODES = {torch.bfloat16: _DT_BF16, torch.float32: _DT_F32}  # the dtypes the C call takes
# The parts decoder_layers.c times, in its order (PART_* there).
FUSED_PARTS = ("matmuls", "attention", "rms_norm", "rotary", "kv_write", "silu_and_mul")
# Seconds per part of FUSED_PARTS, added to by every fused call while not None: the
# prefill profile (benchmarks/bench_prefill_profile.py) sets it.
part_seconds: ctypes.Array | None = None

_WEIGHTS = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
            "gate_up_bias", "down", "down_bias", "k_cache", "v_cache")  # fmt: skip


class _LayerWeights(ctypes.Structure):
    _fields_ = [(name, _ptr) for name in _WEIGHTS]


class _LayerRun(ctypes.Structure):
    _fields_ = [
        *[(name, _i64) for name in ("layers", "tokens", "width", "heads", "kv_heads")],
        ("head_dim", _i64), ("inter", _i64), ("eps", _f32), ("scale", _f32), ("dtype", _int),
        ("kv_dtype", _int), ("kv_head_stride", _i64), ("kv_slot_stride", _i64),
        ("cos", _ptr), ("sin", _ptr), ("out_cache_loc", _ptr), ("req_to_token", _ptr),
        ("table_stride", _i64), ("req_pool_indices", _ptr), ("bs", _i64), ("decode", _int),
        ("prefix_lens", _ptr), ("extend_lens", _ptr), ("seq_lens", _ptr), ("chunk", _i64),
        *[(name, _ptr) for name in ("residual", "hidden", "qkv_out", "attended")],
        ("gate_up_out", _ptr), ("act", _ptr), ("seconds", _ptr),
    ]  # fmt: skip


class FusedLayers:
    """A model's layers as decoder_layers.c takes them, for one KV pool: built on the first
    fused forward, dropped by attach_cpu_kernels (which packs the weights anew). Holds the
    tensors it points at."""

    def __init__(self, model: nn.Module, kv_pool) -> None:
        self.kv_pool = kv_pool
        self.layers = list(model.layers)
        self.dtype = self.layers[0].input_layernorm.weight.dtype  # of every layer (fusable)
        self.modules = [model.embed_tokens, *(m for layer in self.layers for m in layer.modules())]
        # Every module's hook registries (register_forward_hook adds to these very dicts):
        # one any() over them a forward: 3.6 us for SmolLM2, where hooked() took 25 (warm).
        self.hook_dicts = [
            hooks for m in self.modules for hooks in (m._forward_hooks, m._forward_pre_hooks)
        ]
        self.weights = (_LayerWeights * len(self.layers))()
        self.keep: list[torch.Tensor] = []
        pools: list[torch.Tensor] = []  # every layer's keys and values
        for row, layer in zip(self.weights, self.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            k_cache, v_cache = kv_pool.get_kv_buffer(attn.attn.layer_id)
            pools += [k_cache, v_cache]
            tensors = {
                "input_norm": layer.input_layernorm.weight,
                "post_norm": layer.post_attention_layernorm.weight,
                "k_cache": k_cache,
                "v_cache": v_cache,
            }
            linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj}
            for name, linear in {**linears, "down": mlp.down_proj}.items():
                tensors[name], tensors[f"{name}_bias"] = linear.gemm_weight, linear.bias
            for name, tensor in tensors.items():
                if tensor is not None:
                    setattr(row, name, tensor.data_ptr())
                    self.keep.append(tensor)
        first = pools[0]
        self.kv_dtype = _DT_BF16 if first.dtype == torch.bfloat16 else _DT_F32
        self.kv_strides = first.stride(0), first.stride(1)
        # One dtype and layout for every layer's keys and values, as the C call takes them.
        self.kv_uniform = all(
            b.dtype == first.dtype and b.stride() == first.stride() and b.stride(2) == 1
            for b in pools
        )
        # oneDNN multiplies from PACKED_GEMM_FROM_ROWS rows where it holds a packed copy (AMX).
        packed = any(getattr(m, "packed_weight", None) is not None for m in self.modules)
        self.max_rows = PACKED_GEMM_FROM_ROWS - 1 if packed else None


def fusable(model: nn.Module) -> bool:
    """Whether every layer module of `model` would call the fused kernels (shape, dtype,
    packed weights, no tensor parallelism); what a forward adds is checked per call."""
    if not len(model.layers):
        return False
    dtype = model.layers[0].input_layernorm.weight.dtype
    if dtype not in _DTYPE_CODES:
        return False
    for layer in model.layers:
        linears = [m for m in layer.modules() if isinstance(m, Linear)]
        if len(linears) != 4 or any(
            type(m) is not Linear
            or m.gemm_weight is None
            or m.gemm_weight.dtype != dtype
            or m.cpu_kernels is None
            for m in linears
        ):
            return False
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(n.weight.dtype != dtype or n.cpu_kernels is None for n in norms):
            return False
        if layer.mlp.cpu_kernels is None or layer.self_attn.cpu_kernels is None:
            return False
    return True


def run_fused_layers(
    model: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(residual, the last MLP's output) after every layer, as the modules' loop leaves them
    (hidden, the embeddings, is written over); None where the modules must run instead."""
    kernels = model.layers[0].mlp.cpu_kernels if len(model.layers) else None
    if kernels is None or kernels.decoder_layers is None or hidden.dtype not in _DTYPE_CODES:
        return None
    if cos.dtype != hidden.dtype or hidden.dim() != 2 or not hidden.is_contiguous():
        return None
    context = get_forward_context()
    fused_attention = getattr(context.attn_backend, "fused_attention", None)
    attention = fused_attention(context.forward_batch) if fused_attention else None
    if attention is None:
        return None
    fused = model.fused_layers
    if fused is None or fused.kv_pool is not attention.kv_pool:
        if not fusable(model):
            return None
        fused = model.fused_layers = FusedLayers(model, attention.kv_pool)
    if fused.dtype != hidden.dtype or not fused.kv_uniform:
        return None
    if not _int64_vectors(context.forward_batch, attention):
        return None  # the modules' own checks then say what is wrong
    tokens = hidden.shape[0]
    if (fused.max_rows is not None and tokens > fused.max_rows) or any(fused.hook_dicts):
        return None
    return _call(kernels, fused, attention, context.forward_batch, hidden, cos, sin)


def _int64_vectors(batch, attention) -> bool:
    """Whether the batch's slot and index tensors are the int64 rows the C code reads."""
    vectors = (batch.out_cache_loc, batch.req_pool_indices, attention.req_to_token)
    return all(v.dtype == torch.int64 and v.stride(-1) == 1 for v in vectors)


def _call(kernels, fused, attention, batch, hidden, cos, sin):
    """decoder_layers on this forward's buffers: (residual, the last MLP's output), or
    None where the attention kernel declined the shape."""
    first = fused.layers[0]
    attn = first.self_attn
    tokens, width = hidden.shape
    inter = first.mlp.gate_up_proj.weight.shape[0] // 2
    heads, kv_heads, head_dim = attn.attn.num_heads, attn.attn.num_kv_heads, attn.attn.head_dim
    qkv_width = (heads + 2 * kv_heads) * head_dim

    def buffer(columns: int) -> torch.Tensor:
        return torch.empty(tokens, columns, dtype=hidden.dtype)

    pending, qkv = buffer(width), buffer(qkv_width)
    attended, gate_up, act = buffer(heads * head_dim), buffer(2 * inter), buffer(inter)
    loc, indices = batch.out_cache_loc.contiguous(), batch.req_pool_indices.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    run = _LayerRun(
        layers=len(fused.layers), tokens=tokens, width=width, heads=heads, kv_heads=kv_heads,
        head_dim=head_dim, inter=inter, eps=first.input_layernorm.eps, scale=attn.attn.scaling,
        dtype=_DTYPE_CODES[hidden.dtype],
        kv_dtype=fused.kv_dtype, kv_head_stride=fused.kv_strides[0],
        kv_slot_stride=fused.kv_strides[1], cos=cos.data_ptr(), sin=sin.data_ptr(),
        out_cache_loc=loc.data_ptr(), req_to_token=attention.req_to_token.data_ptr(),
        table_stride=attention.req_to_token.stride(0), req_pool_indices=indices.data_ptr(),
        bs=tokens if attention.decode else len(attention.extend_lens),
        decode=int(attention.decode),
        prefix_lens=attention.prefix_lens.data_ptr(),
        extend_lens=attention.extend_lens.data_ptr(), seq_lens=attention.seq_lens.data_ptr(),
        chunk=attention.chunk, residual=hidden.data_ptr(), hidden=pending.data_ptr(),
        qkv_out=qkv.data_ptr(), attended=attended.data_ptr(),
        gate_up_out=gate_up.data_ptr(), act=act.data_ptr(),
        seconds=None if part_seconds is None else ctypes.addressof(part_seconds),
    )  # fmt: skip
    status = kernels.decoder_layers(fused.weights, ctypes.byref(run))
    if status == -1:
        return None  # the attention kernel declines the shape: the modules take the batch
    if status != 0:
        raise RuntimeError(f"decoder_layers failed with status {status}")
    return hidden, pending
