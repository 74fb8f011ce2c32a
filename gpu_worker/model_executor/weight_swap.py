"""New weights into a serving ModelRunner: load and check them apart, then copy them in.

`load_checked` builds the new model beside the serving one and refuses it (a
`WeightsRejected` saying why) unless it is the same model with other numbers: the same config
(every field but the checkpoint's storage dtype: rope, norms and special tokens live in the
running modules, not in their weights), the same parameters with the same shapes and dtypes,
and a self-check forward that gives finite logits (and agrees with torch_native where a
faster backend serves: model_executor/self_check.py). Until `swap_in`, the serving model is
untouched, so any failure leaves it serving as before.

`swap_in` copies the new tensors into the serving model's parameters in place rather than
replacing the module: captured CUDA graphs hold those parameters' addresses, and forward
hooks are registered on those modules, so both go on working without a capture or a
registration again. CPU kernels pack bfloat16 weights at attach time, so they are attached
again. The cost is memory: the two copies of the weights live at once while the new one is
checked; a GPU without room for a second copy fails the load (out of memory), and the worker
goes on serving the old weights.

The tokenizer is the serving one's: the tokenizer stage tokenizes for every worker, so new
weights must share the vocabulary (their config's vocab_size and special tokens are checked).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from gpu_worker.model_executor.model_runner import ModelRunner
from gpu_worker.model_executor.self_check import check_new_weights
from gpu_worker.models.layers import attach_cpu_kernels
from gpu_worker.models.loader import load_model

# Fields of ModelConfig that may differ: how the checkpoint stores its tensors (they are
# loaded into the serving dtype whatever it is).
_STORAGE_ONLY = frozenset({"torch_dtype"})


class WeightsRejected(ValueError):
    """New weights that cannot serve in this runner; the message says why."""


def load_checked(runner: ModelRunner, source: str) -> nn.Module:
    """The model `source` names, loaded in the runner's dtype on its device and checked
    against the serving one. Needs an empty KV pool (the self-check writes into it)."""
    try:
        loaded = load_model(source, runner.dtype, runner.device, seed=runner.config.seed)
    except Exception as exc:  # missing, malformed (safetensors' own errors), out of memory
        raise WeightsRejected(f"cannot load {source!r}: {type(exc).__name__}: {exc}") from exc
    differs = _config_differences(runner, loaded.config)
    if differs:
        raise WeightsRejected(f"{source!r} is another model shape: {'; '.join(differs)}")
    _check_parameters(runner.model, loaded.model, source)
    result = check_new_weights(runner, loaded.model)
    if not result.ok:
        raise WeightsRejected(f"{source!r} failed its self-check forward: {result.detail}")
    return loaded.model


def swap_in(runner: ModelRunner, new_model: nn.Module) -> None:
    """Copy `new_model`'s weights into the serving model (checked by `load_checked`)."""
    serving = dict(runner.model.named_parameters())
    with torch.no_grad():
        for name, tensor in new_model.named_parameters():
            serving[name].copy_(tensor)
    attach_cpu_kernels(runner.model, runner.cpu_kernels)  # packs the new weights again
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)  # the copies are done before anything reads them


def _config_differences(runner: ModelRunner, new: object) -> list[str]:
    old = runner.model_config
    return [
        f"{f.name} {getattr(new, f.name)!r}, serving {getattr(old, f.name)!r}"
        for f in dataclasses.fields(old)
        if f.name not in _STORAGE_ONLY and getattr(new, f.name) != getattr(old, f.name)
    ]


def _check_parameters(serving: nn.Module, new: nn.Module, source: str) -> None:
    """Same names, shapes and dtypes: what an in-place copy needs (the config check makes a
    difference here unlikely, but a copy_ that broadcasts would hide one)."""
    old = {name: (tuple(p.shape), p.dtype) for name, p in serving.named_parameters()}
    got = {name: (tuple(p.shape), p.dtype) for name, p in new.named_parameters()}
    if old.keys() != got.keys():
        extra, missing = sorted(got.keys() - old.keys()), sorted(old.keys() - got.keys())
        raise WeightsRejected(f"{source!r} has other parameters: extra {extra}, missing {missing}")
    for name, (shape, dtype) in old.items():
        if got[name] != (shape, dtype):
            raise WeightsRejected(
                f"{source!r}: parameter {name} is {got[name][0]} {got[name][1]}, "
                f"serving {shape} {dtype}"
            )
