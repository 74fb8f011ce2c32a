"""Hook factories the forward-hook tests name by import path."""

from __future__ import annotations

CALLS: dict[str, int] = {}


def count_calls(config: dict):
    key = config["key"]
    CALLS[key] = 0

    def hook(module, args, output):
        CALLS[key] += 1

    return hook


def force_token(config: dict):
    """Make every logit row prefer one token: changes what the model generates."""
    token = config["token"]

    def hook(module, args, output):
        output = output.clone()
        output[..., token] = output.max() + 100.0
        return output

    return hook


KEPT: dict[str, list] = {}


def keep_outputs(config: dict):
    """Keep every tensor a module takes or returns, with a copy of each: the model must not
    write over a tensor a hook holds (gpu_worker/models/llama.py writes over its own
    intermediates)."""
    kept = KEPT.setdefault(config["key"], [])

    def hook(module, args, output):
        for tensor in (*args, output):
            if hasattr(tensor, "clone"):
                kept.append((tensor, tensor.clone()))

    return hook


def returns_none(config: dict):
    return None


NOT_CALLABLE = 42


def raise_on_token(config: dict):
    """Make every forward whose batch holds token `token` raise: a job that breaks the step."""
    from gpu_worker.model_executor.forward_context import get_forward_context

    token = config["token"]

    def hook(module, args, output):
        if bool((get_forward_context().forward_batch.input_ids == token).any()):
            raise RuntimeError(f"token {token} breaks this step")

    return hook


def slow_down(config: dict):
    """Sleep in every forward: a job that runs for seconds on a tiny model."""
    import time

    seconds = config["seconds"]

    def hook(module, args, output):
        time.sleep(seconds)

    return hook
