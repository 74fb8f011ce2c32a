"""Helpers the tensor-parallel tests name by import path: a forward hook that reports what
its rank holds, and a process that serves a split model until it is killed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def report_shard(config: dict):
    """A hook on `model` (LlamaModel) writing, once per rank, the parameter shapes it holds
    to <dir>/rank<r>.json: the only way to see a follower's weights from outside."""
    out = Path(config["dir"])

    def hook(module, args, output):
        import torch.distributed as dist

        from gpu_worker.model_executor.forward_context import get_forward_context

        path = out / f"rank{dist.get_rank()}.json"
        if not path.exists():
            shapes = {name: list(p.shape) for name, p in module.named_parameters()}
            kv_pool = get_forward_context().attn_backend.kv_pool
            report = {"pid": os.getpid(), "shapes": shapes, "kv_slots": kv_pool.size}
            path.write_text(json.dumps(report))

    return hook


def steer(config: dict):
    """Add a constant to a module's output: a hook that changes what is generated."""
    amount = config["amount"]

    def hook(module, args, output):
        return output + amount

    return hook


def serve_until_killed() -> None:
    """Start a tp 2 engine, print the follower's pid, then generate forever."""
    from gpu_worker import Engine

    engine = Engine("random:micro-llama", dtype="float32", tp=2, max_total_tokens=4096)
    print(engine.runner.tp_leader.followers[0].pid, flush=True)
    while True:
        engine.generate(input_ids=[[1, 2, 3]], sampling_params={"max_new_tokens": 8})


def generate_through_a_raising_hook() -> None:
    """A tp 2 engine whose forward raises (on every rank) on token 7, asked for token 7."""
    from gpu_worker import Engine

    factory = "tests.hook_factories:raise_on_token"
    hooks = [{"name": "raise", "target_modules": ["model.layers.0"],
              "hook_factory": factory, "config": {"token": 7}}]  # fmt: skip
    engine = Engine("random:micro-llama", dtype="float32", tp=2, max_total_tokens=4096,
                    forward_hooks=hooks)  # fmt: skip
    engine.generate(input_ids=[[1, 7]], sampling_params={"max_new_tokens": 4})


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    serve_until_killed()
if __name__ == "__main__" and sys.argv[1:] == ["raise"]:
    generate_through_a_raising_hook()
