"""ModelRunner: owns the model, the KV memory and the attention backend; runs one forward.

It loads the weights, sizes the KV pool (from a memory budget on CPU, from free memory on
CUDA), registers forward hooks, and dispatches a ForwardBatch by mode. Batch forming and
sampling live elsewhere: this class turns a batch into logits.

With `tp` > 1 every rank has a ModelRunner over its share of the model (gpu_worker/parallel):
rank 0's starts the others and sends each forward to them before running it; the KV pool
holds this rank's heads, sized by the rank with the least room.
"""

from __future__ import annotations

import logging

import torch

from gpu_worker.attention.registry import create_attention_backend, resolve_backend_name
from gpu_worker.config import EngineConfig
from gpu_worker.kernels.cpu_kernels import load as load_cpu_kernels
from gpu_worker.memory.allocator import PagedTokenAllocator
from gpu_worker.memory.gpu_memory import forward_activation_bytes, plan_gpu_kv_pool
from gpu_worker.memory.kv_pool import TokenToKVPool, check_fits_in_memory
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.cpu_malloc import keep_freed_memory_in_heap
from gpu_worker.model_executor.forward_batch import MAX_PROMPT_LOGIT_ROWS, ForwardBatch
from gpu_worker.model_executor.forward_context import (
    ForwardContext,
    capture_forward_context,
    forward_context,
)
from gpu_worker.model_executor.graph_runner import DecodeGraphRunner, capture_sizes
from gpu_worker.model_executor.hooks import ForwardHooks
from gpu_worker.model_executor.self_check import SAFE_BACKEND, checked_backend, verified_graphs
from gpu_worker.models.layers import attach_cpu_kernels
from gpu_worker.models.loader import load_model
from gpu_worker.parallel.shard import TPShard

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, tp_rank: int = 0) -> None:
        """`tp_rank`: this process's rank when `config.tp` > 1 (a follower has joined the
        group already, gpu_worker/parallel/follower.py; rank 0 starts it here)."""
        self.config = config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        self.tp_leader = None
        if config.tp > 1 and tp_rank == 0:
            from gpu_worker.parallel.launch import TensorParallelLeader

            self.tp_leader = TensorParallelLeader(config, type(self))
        shard = TPShard(tp_rank, config.tp)
        loaded = load_model(config.model, self.dtype, self.device, config.seed, shard)
        self.model = loaded.model
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_source = loaded.source
        self.forward_hooks = ForwardHooks(self.model, config.forward_hooks)
        self.kv_heads = self.model.plan.kv_heads  # this rank's

        self.page_size = config.page_size
        self.max_total_tokens = self._kv_pool_tokens()
        self.context_length = min(
            config.context_length or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
        )
        # A request longer than the pool could never finish; the row width never needs more.
        row_width = min(self.context_length, self.max_total_tokens)
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests, row_width, self.device)
        self.kv_pool = TokenToKVPool(
            self.max_total_tokens,
            self.page_size,
            self.dtype,
            self.model_config.num_hidden_layers,
            self.kv_heads,
            self.model_config.head_dim,
            self.device,
        )
        if self.tp_leader is not None:  # a follower's rows are copies of these writes
            self.req_to_token_pool.journal = []
        self.allocator = PagedTokenAllocator(self.max_total_tokens, self.page_size, self.device)
        # None on GPUs, when turned off, or where no C compiler builds them (one warning).
        self.cpu_kernels = (
            load_cpu_kernels() if self.device.type == "cpu" and config.cpu_kernels else None
        )
        attach_cpu_kernels(self.model, self.cpu_kernels)
        backend_name = resolve_backend_name(
            config.attention_backend, self.device, self.cpu_kernels is not None
        )
        # attention_path says what serves, for the start-up line, the heartbeat and /health.
        if self.device.type == "cuda" and config.tp > 1 and backend_name != SAFE_BACKEND:
            # The self-check runs forwards on rank 0 alone, which a split model cannot.
            logger.info("tensor parallel: attention %s (the self-check is single-rank)",
                        SAFE_BACKEND)  # fmt: skip
            backend_name = SAFE_BACKEND
        if self.device.type == "cuda" and backend_name != SAFE_BACKEND:
            # A fast backend serves only once it agrees with torch_native on this device.
            self.attn_backend, self.attention_path = checked_backend(self, backend_name)
        else:
            self.attn_backend = create_attention_backend(
                backend_name, self.req_to_token_pool, self.kv_pool, self.cpu_kernels
            )
            self.attention_path = backend_name
        self.graph_runner = self._capture_decode_graphs()
        logger.info(
            "model %s on %s/%s: KV pool %d tokens (page %d), attention %s, CPU kernels %s",
            self.model_source,
            self.device,
            self.dtype,
            self.max_total_tokens,
            self.page_size,
            self.serving_path(),
            "on" if self.cpu_kernels is not None else "off",
        )

    def serving_path(self) -> str:
        """What serves attention and decode, as the heartbeat and /health show it."""
        graphs = ", CUDA graphs" if self.graph_runner is not None else ""
        ranks = f", tensor parallel {self.config.tp}" if self.config.tp > 1 else ""
        return f"{self.attention_path}{graphs}{ranks}"

    def _capture_decode_graphs(self) -> DecodeGraphRunner | None:
        """CUDA graphs for decode where they can be had; None (eager), with a line why."""
        if self.device.type != "cuda" or not self.config.cuda_graphs:
            return None
        if self.config.forward_hooks:
            logger.info("CUDA graphs off: forward hooks are configured (a replay skips them)")
            return None
        if self.config.tp > 1:
            logger.info("CUDA graphs off: tensor parallel steps run eager")
            return None
        graphs = DecodeGraphRunner(self, capture_sizes(self.config.max_running_requests))
        try:
            graphs.capture()
        except NotImplementedError as reason:
            logger.info("CUDA graphs off: %s; decoding eager", reason)
            return None
        return verified_graphs(self, graphs)

    def _kv_pool_tokens(self) -> int:
        cfg = self.model_config
        per_token = TokenToKVPool.bytes_per_token(
            self.dtype, cfg.num_hidden_layers, self.kv_heads, cfg.head_dim
        )
        if self.config.max_total_tokens is not None:
            tokens = self.config.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            rows = self.config.max_running_requests
            # Captured graphs keep the largest decode's activations in their own pool.
            graph_pool = (
                forward_activation_bytes(self.model_config, self.dtype.itemsize, rows, rows)
                if self.config.cuda_graphs
                else 0
            )
            plan = plan_gpu_kv_pool(
                total, free, self.config.mem_fraction_static, per_token,
                self._peak_activation_bytes(), graph_pool, self.page_size,
            )  # fmt: skip
            tokens = plan.kv_tokens
        else:
            tokens = int(self.config.kv_cache_memory_gb * 2**30 // per_token)
        if self.device.type == "cpu":
            check_fits_in_memory(tokens * per_token)
        if self.config.tp > 1:
            from gpu_worker.parallel.group import tp_group

            # One pool size for all: every rank holds every slot (for its own heads).
            tokens = tp_group().min_over_ranks(tokens)
        tokens -= tokens % self.page_size
        if tokens < self.page_size:
            raise ValueError(
                f"the KV pool would hold {tokens} tokens: raise max_total_tokens or the memory "
                "budget (kv_cache_memory_gb / mem_fraction_static)"
            )
        return tokens

    def _peak_activation_bytes(self) -> int:
        """The largest forward the scheduler can form: a full prefill chunk (one request's
        prompt logits among its rows), a full decode batch, or a full batch verifying drafts
        (logits for every token)."""
        config, dtype_bytes = self.config, self.dtype.itemsize
        rows = config.max_running_requests
        chunk = config.chunked_prefill_size
        forwards = [(chunk, min(rows + MAX_PROMPT_LOGIT_ROWS, chunk))]
        forwards.append((rows, rows))
        if config.speculative is not None:
            verify_tokens = rows * (config.num_draft_tokens + 1)
            forwards.append((verify_tokens, verify_tokens))
        return max(
            forward_activation_bytes(self.model_config, dtype_bytes, tokens, logit_rows)
            for tokens, logit_rows in forwards
        )

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits of each request's last new token, [bs, vocab] float32; in TARGET_VERIFY
        mode, of every new token, [num_tokens, vocab]; then those of the prompt positions
        the batch asks for (`ForwardBatch.prompt_logit_indices`). Decode batches go through
        the CUDA graphs when they are captured and the batch fits one."""
        if self.tp_leader is not None:  # the followers run it too (no CUDA graphs under TP)
            pool = self.req_to_token_pool
            return self.tp_leader.run_step(forward_batch, pool, self.forward_eager)
        if self.graph_runner is not None and self.graph_runner.can_run(forward_batch):
            return self.graph_runner.run(forward_batch)
        return self.forward_eager(forward_batch)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if this is rank 0 of several."""
        if self.tp_leader is not None:
            self.tp_leader.stop()
            self.tp_leader = None

    @torch.inference_mode()
    def forward_eager(self, forward_batch: ForwardBatch) -> torch.Tensor:
        with forward_context(ForwardContext(self.attn_backend, forward_batch)):
            self.attn_backend.prepare_metadata(forward_batch)
            return self._logits(forward_batch)

    def forward_captured(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """The forward a CUDA graph records: the metadata is prepared outside it."""
        with capture_forward_context(ForwardContext(self.attn_backend, forward_batch)):
            return self._logits(forward_batch)

    def _logits(self, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(forward_batch.input_ids, forward_batch.positions)
        if forward_batch.pool_ranges:  # an extend with embeddings in it (never a decode)
            forward_batch.pooled = forward_batch.pool_sums(hidden)
        return self.model.compute_logits(hidden[forward_batch.logit_indices()])
