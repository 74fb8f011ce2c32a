"""The model side of streamserve: the worker stage and the engine it drives. The only
package that imports torch.

worker.py          the worker stage: jobs in, the engine loop, tokens out
token_item.py      what the worker publishes of a running job
job_intake.py      the thread that reads new jobs off the worker's stream
job_admission.py   each job read started, refused, set aside or dropped (a Worker mixin)
job_ends.py        each job's end marked on the log, and its entry acknowledged after its last
publishing.py      when a busy worker publishes (per interval), and its items and log entry
progress_log.py    the worker's side of its progress log: the next entry, the trim point
cached_blocks.py   the blocks the prefix cache holds, and the next KvEvents entry
probation.py       the jobs of a step that raised, admitted again one at a time
grammar_waits.py   jobs whose grammar compiles beside the engine
heartbeat.py       the heartbeat thread: load figures under a key with a TTL
weights_update.py  the weights a worker serves, and its updates: drain, load, check, swap
worker_metrics.py  what a worker measures (vLLM's names)
engine.py          `Engine`, the in-process API (`generate`, `generate_stream`)
synthetic_engine.py  no model: tokens at a set rate for bus load tests (`--synthetic` only)
text_stream.py     incremental detokenization that never leaks a stop string
config.py          `EngineConfig`: every engine option, validated
cli.py, __main__.py  `python -m gpu_worker` (what `streamserve worker` runs)
chat.py            `python -m gpu_worker.chat`: one chat answer from the engine
gpu_check.py       `streamserve gpu-check`: the GPU path checked and measured
hf_reference.py    transformers as the reference (the correctness anchor)
scheduling/        the scheduler, requests, batches, admission policies, fair share
memory/            the KV pools, the paged allocator, the radix (prefix) cache
model_executor/    ModelRunner, ForwardBatch, ForwardContext, CUDA graphs, self-check, hooks
attention/         attention backends: torch_native, cpu_kernel, flashinfer
models/            the Llama family, configs, weight loading, GGUF conversion, random shapes
kernels/           C kernels for CPU, compiled at first use
sampling/          sampler, penalties, logit bias, grammar masks, logprobs
speculative/       n-gram and draft-model drafting, verification
parallel/          tensor parallelism: a model split over `tp` ranks of one worker
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_worker.engine import Engine

__all__ = ["Engine"]


def __getattr__(name: str):
    # Import lazily: `import gpu_worker` should not pay for torch until the engine is used.
    if name == "Engine":
        from gpu_worker.engine import Engine

        return Engine
    raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
