"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat batch of tokens.

Numerics follow transformers' LlamaForCausalLM: RMSNorm in float32, rotary cos/sin from
float32 frequencies, SiLU-gated MLP. Q/K/V and gate/up are fused into one Linear each (fewer
matmuls); `load_weights` takes transformers' parameter names and fills the right shard.

Under tensor parallelism (a ShardPlan over more than one rank, gpu_worker/parallel) each
rank builds only its share: its heads, MLP columns and vocabulary rows, with o_proj and
down_proj row-parallel (one all-reduce each) and a vocabulary-parallel embedding and lm_head.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.attention.layer import PagedAttention
from gpu_worker.kernels.cpu_kernels import CpuKernels
from gpu_worker.models.config import ModelConfig
from gpu_worker.models.fused_layers import FusedLayers, run_fused_layers
from gpu_worker.models.layers import Linear, RMSNorm, hooked
from gpu_worker.models.rotary import RotaryEmbedding, apply_rotary
from gpu_worker.parallel.layers import (
    RowParallelLinear,
    VocabParallelEmbedding,
    gather_vocab_logits,
)
from gpu_worker.parallel.shard import ShardPlan, TPShard


class LlamaAttention(nn.Module):
    # Attached on CPU (layers.attach_cpu_kernels): rotary then runs in place in one pass.
    cpu_kernels: CpuKernels | None = None

    def __init__(
        self, config: ModelConfig, layer_id: int, dtype: torch.dtype | None, plan: ShardPlan
    ) -> None:
        super().__init__()
        self.num_heads = plan.num_heads  # this rank's heads: all of them unless split
        self.num_kv_heads = plan.kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=config.attention_bias,
            dtype=dtype,
        )
        # transformers' Llama puts attention_bias on o_proj too; Qwen2 does not.
        o_bias = config.attention_bias and config.architecture == "LlamaForCausalLM"
        o_proj = RowParallelLinear if plan.is_split else Linear
        self.o_proj = o_proj(self.q_size, config.hidden_size, bias=o_bias, dtype=dtype)
        self.attn = PagedAttention(
            layer_id, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qk, v = self.qkv_proj(hidden).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads sit side by side: one rotary call covers both (fewer ops per layer).
        heads = self.num_heads + self.num_kv_heads
        qk = qk.reshape(num_tokens, heads, self.head_dim)
        # In place into qkv, this call's own tensor, unless a hook on qkv_proj kept it.
        kernels = None if self.qkv_proj._forward_hooks else self.cpu_kernels
        if kernels is not None and cos.dtype == qk.dtype:
            kernels.rotary_inplace(qk, cos, sin)
        else:
            qk = apply_rotary(qk, cos, sin)
        q, k = qk.reshape(num_tokens, -1).split([self.q_size, self.kv_size], dim=-1)
        out = self.attn(q, k, v)  # row-strided views into qkv: backends read them in place
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    # Attached by the ModelRunner on CPU (attach_cpu_kernels): silu * up in one pass.
    cpu_kernels: CpuKernels | None = None

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None, plan: ShardPlan) -> None:
        super().__init__()
        inter = plan.intermediate_size  # this rank's columns
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False, dtype=dtype)
        down_proj = RowParallelLinear if plan.is_split else Linear
        self.down_proj = down_proj(inter, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels, gate_up_proj = self.cpu_kernels, self.gate_up_proj
        packed = gate_up_proj.gemm_weight
        if kernels is not None and packed is not None and x.dim() == 2 and x.shape[0]:
            # float32 on gemm_f32: the activation in the matmul's epilogue, so the product
            # twice its size never goes to memory (1.08-1.12x the two calls at 256-2048
            # rows). Unless a hook on gate_up_proj must see it called.
            if not hooked(gate_up_proj):
                activated = kernels.gemm_silu_mul(x, packed, gate_up_proj.bias)
                if activated is not None:
                    return self.down_proj(activated)
        gate_up = gate_up_proj(x)
        if kernels is not None and gate_up.dim() == 2:
            activated = kernels.silu_and_mul(gate_up)
            if activated is not None:
                return self.down_proj(activated)
        gate, up = gate_up.chunk(2, dim=-1)
        # In place: both halves are this call's own intermediates, and a fresh tensor of
        # prefill size costs more in page faults than the arithmetic (45 vs 30 ms on CPU).
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_id: int, dtype: torch.dtype | None, plan: ShardPlan
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, dtype, plan)
        self.mlp = LlamaMLP(config, dtype, plan)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        residual, mlp_out = self.forward_unsummed(hidden, None, cos, sin)
        return residual + mlp_out

    def forward_unsummed(
        self,
        residual: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        owned: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer on the hidden state `residual + pending` (pending None: `residual`
        alone), returning its output the same way, as (residual, MLP output) not yet added:
        the next layer's input norm (or the final norm) adds them in its own pass, where an
        add on torch wrote a prefill-size sum only for the norm to read it again.

        `owned`: residual and pending are the caller's intermediates, which nothing else
        holds, so the input norm may write over them; the post-attention norm writes over
        its own operands when no hook has seen them (`outputs_owned` says the same of what
        this returns)."""
        if pending is None:
            normed = self.input_layernorm(residual)
        else:
            residual, normed = self.input_layernorm.add_then_norm(pending, residual, owned)
        attended = self.self_attn(normed, cos, sin)
        # The sum is the input norm's own unless a hook on that norm saw it (its torch path),
        # and attention's output o_proj's own unless a hook on either module saw it.
        overwrite = pending is not None and not hooked(
            self.input_layernorm, self.self_attn, self.self_attn.o_proj
        )
        residual, normed = self.post_attention_layernorm.add_then_norm(
            attended, residual, overwrite
        )
        return residual, self.mlp(normed)

    def outputs_owned(self) -> bool:
        """Whether forward_unsummed's two outputs are tensors no hook has seen."""
        return not hooked(self.post_attention_layernorm, self.mlp, self.mlp.down_proj)


class LlamaModel(nn.Module):
    # The layers as one C call takes them on CPU (fused_layers.py): built on first use,
    # dropped when attach_cpu_kernels packs the weights anew.
    fused_layers: FusedLayers | None = None

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None, plan: ShardPlan) -> None:
        super().__init__()
        if plan.is_split:
            self.embed_tokens = VocabParallelEmbedding(
                plan.vocab_rows, plan.vocab_range[0], config.hidden_size, dtype
            )
        else:
            # Given its weight, nn.Embedding skips its normal_ init, which on the meta device
            # (LlamaForCausalLM.empty) imported torch._dynamo: 0.3-0.4 s of a worker's start.
            weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype)
            self.embed_tokens = nn.Embedding(*weight.shape, dtype=dtype, _weight=weight)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype, plan) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # One cos/sin for all layers: the positions are the same in each.
        cos, sin = self.rotary_emb(positions, hidden.dtype)
        fused = run_fused_layers(self, hidden, cos, sin)
        if fused is not None:  # every layer in one C call, as the loop below would run them
            hidden, pending = fused
            return self.norm.add_then_norm(pending, hidden, True)[1]
        pending = None  # the last layer's MLP output, not yet added to hidden
        owned = False  # whether hidden and pending are this forward's, seen by no hook
        for layer in self.layers:
            if hooked(layer):
                # A hook on the layer sees (and may change) its whole output.
                if pending is not None:
                    hidden, pending = hidden + pending, None
                hidden, owned = layer(hidden, cos, sin), False
            else:
                hidden, pending = layer.forward_unsummed(hidden, pending, cos, sin, owned)
                owned = layer.outputs_owned()
        if pending is None:
            return self.norm(hidden)
        return self.norm.add_then_norm(pending, hidden, owned)[1]


class LlamaForCausalLM(nn.Module):
    # fused parameter, checkpoint name, shard id (see _shard_slice)
    stacked_params_mapping = [
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype | None = None, plan: ShardPlan | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.plan = plan or ShardPlan(config, TPShard())
        self.model = LlamaModel(config, dtype, self.plan)
        vocab_rows = self.plan.vocab_rows if self.plan.is_split else config.vocab_size
        self.lm_head = Linear(config.hidden_size, vocab_rows, bias=False, dtype=dtype)
        self.tie_weights()

    @classmethod
    def empty(
        cls,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        plan: ShardPlan | None = None,
    ) -> LlamaForCausalLM:
        """Allocate without initializing; every weight must then be loaded or filled."""
        with torch.device("meta"):
            model = cls(config, dtype, plan)
        _allocate_in_place(model, torch.device(device))
        # Tied modules got separate tensors and buffers are uninitialized.
        model.tie_weights()
        model.model.rotary_emb.reset_inv_freq()
        return model

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> final-normed hidden [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 (the matmul runs in the model dtype, as in HF);
        split over ranks, each computes its vocabulary share and all gather them."""
        logits = self._own_logits(hidden)
        if self.plan.is_split:
            return gather_vocab_logits(logits, self.config.vocab_size)
        return logits

    def _own_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hooked = self.lm_head._forward_hooks or self.lm_head._forward_pre_hooks
        kernels = self.lm_head.cpu_kernels is not None  # few rows or a packed weight
        if hidden.device.type == "cpu" and hidden.shape[0] > 1 and not hooked and not kernels:
            # MKL's GEMM for a few rows against a vocabulary-wide weight runs 2-4x slower
            # than the same product with the operands swapped (49152 x 576 fp32: 40 ms
            # against 12 ms at 5 rows, 86 against 40 at 64); this is every verify step and
            # every batched decode step. (A forward hook on lm_head needs the module call.)
            return (self.lm_head.weight @ hidden.t()).t().float()
        return self.lm_head(hidden).float()

    def _shard_slice(self, shard: str | int) -> slice:
        # This rank's sizes (the whole model's unless split): the checkpoint tensors that
        # reach load_weights are already cut to them (ShardPlan.take).
        if isinstance(shard, int):  # gate_up_proj: equal halves
            size = self.plan.intermediate_size
            return slice(shard * size, (shard + 1) * size)
        q_size = self.plan.num_heads * self.config.head_dim
        kv_size = self.plan.kv_heads * self.config.head_dim
        start = {"q": 0, "k": q_size, "v": q_size + kv_size}[shard]
        return slice(start, start + (q_size if shard == "q" else kv_size))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors in; raise on unknown names and on anything left out.
        A split model takes each tensor's share for this rank (ShardPlan.take), not all of it."""
        params = dict(self.named_parameters())
        expected = {name: self._expected_shards(name) for name in params}
        loaded: dict[str, set[str | int | None]] = {name: set() for name in params}
        for hf_name, tensor in weights:
            if hf_name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config, never loaded
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some tied checkpoints still store a copy of the embedding
            name, shard = self._resolve(hf_name)
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has no parameter in {type(self).__name__} "
                    f"(config architecture {self.config.architecture})"
                )
            target = params[name].data
            if shard is not None:
                target = target[self._shard_slice(shard)]
            if target.shape != tensor.shape:
                raise ValueError(
                    f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded[name].add(shard)
        missing = sorted(name for name in params if loaded[name] != expected[name])
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing)}")

    def _resolve(self, hf_name: str) -> tuple[str, str | int | None]:
        for fused, part, shard in self.stacked_params_mapping:
            if f".{part}." in hf_name:
                return hf_name.replace(f".{part}.", f".{fused}."), shard
        return hf_name, None

    def _expected_shards(self, name: str) -> set[str | int | None]:
        shards = {shard for fused, _, shard in self.stacked_params_mapping if f".{fused}." in name}
        return shards or {None}


# architecture name (config.json "architectures") -> model class
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}


def _allocate_in_place(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer uninitialized storage on `device`.

    What `Module.to_empty` does, but through `torch.empty` on the shape: `to_empty` calls
    `empty_like` on meta tensors, whose Python meta kernel imports torch._refs' decompositions
    and sympy, 0.3 s of a worker's start (measured in a fresh process) for nothing it uses.
    """
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                storage = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = nn.Parameter(storage, param.requires_grad)
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
