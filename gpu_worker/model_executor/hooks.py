"""Forward hooks configured by name: observe or change a module's output without forking a model.

A spec is `{name, target_modules, hook_factory, config}`. `target_modules` are fnmatch globs
over `model.named_modules()`; `hook_factory` is "pkg.mod:fn" or "pkg.mod.fn", called once
with `config` and returning a `torch` forward hook `(module, args, output) -> output | None`.
A path that does not resolve fails start-up; a spec that matches nothing, or a factory that
returns None, only logs a warning, so one optional hook cannot take a worker down.
"""

from __future__ import annotations

import fnmatch
import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForwardHookSpec:
    name: str
    target_modules: tuple[str, ...]
    hook_factory: str
    config: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> ForwardHookSpec:
        if not isinstance(spec, Mapping):
            raise ValueError(f"forward_hooks: each entry must be a dict, got {spec!r}")
        unknown = set(spec) - {"name", "target_modules", "hook_factory", "config"}
        if unknown:
            raise ValueError(f"forward_hooks: unknown keys {sorted(unknown)} in {spec!r}")
        for key in ("name", "target_modules", "hook_factory"):
            if key not in spec:
                raise ValueError(f"forward_hooks: entry {spec!r} is missing {key!r}")
        targets = spec["target_modules"]
        if isinstance(targets, str):
            targets = [targets]
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ValueError(f"forward_hooks[{spec['name']!r}].target_modules must be globs")
        config = spec.get("config") or {}
        if not isinstance(config, Mapping):
            raise ValueError(f"forward_hooks[{spec['name']!r}].config must be a dict")
        return cls(str(spec["name"]), tuple(targets), str(spec["hook_factory"]), dict(config))


@dataclass
class RegisteredHook:
    name: str
    module_name: str
    handle: RemovableHandle


def resolve_factory(path: str) -> Callable[..., Any]:
    """Import "pkg.mod:fn" or "pkg.mod.fn"; raise ValueError saying what is wrong."""
    if ":" in path:
        module_name, _, attribute = path.partition(":")
    else:
        module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute or not module_name.replace(".", "").isidentifier():
        raise ValueError(
            f"hook_factory {path!r} is malformed: write 'package.module:function' "
            "or 'package.module.function'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"hook_factory {path!r}: cannot import {module_name!r}: {error}"
        ) from error
    factory = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ValueError(f"hook_factory {path!r}: {module_name!r} has no attribute {part!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise ValueError(f"hook_factory {path!r} is not callable")
    return factory


class ForwardHooks:
    """The hooks registered on one model, with their handles so they can be removed."""

    def __init__(self, model: nn.Module, specs: Sequence[Mapping[str, Any] | ForwardHookSpec]):
        self.registered: list[RegisteredHook] = []
        parsed = [
            s if isinstance(s, ForwardHookSpec) else ForwardHookSpec.from_dict(s) for s in specs
        ]
        # Resolve every path before registering anything: a bad spec fails start-up whole.
        factories = [resolve_factory(spec.hook_factory) for spec in parsed]
        modules = list(model.named_modules())
        for spec, factory in zip(parsed, factories, strict=True):
            self._register(spec, factory, modules)

    def _register(self, spec: ForwardHookSpec, factory: Callable[..., Any], modules) -> None:
        matched = [
            (name, module)
            for name, module in modules
            if any(fnmatch.fnmatchcase(name, glob) for glob in spec.target_modules)
        ]
        if not matched:
            logger.warning("forward hook %r matched no module (%s)", spec.name, spec.target_modules)
            return
        hook = factory(dict(spec.config))
        if hook is None:
            logger.warning(
                "forward hook %r: factory %s returned None", spec.name, spec.hook_factory
            )
            return
        for module_name, module in matched:
            handle = module.register_forward_hook(hook)
            self.registered.append(RegisteredHook(spec.name, module_name, handle))

    def remove(self, name: str | None = None) -> int:
        """Remove the hooks called `name` (all when None); return how many were removed."""
        keep, removed = [], 0
        for hook in self.registered:
            if name is None or hook.name == name:
                hook.handle.remove()
                removed += 1
            else:
                keep.append(hook)
        self.registered = keep
        return removed

    def __len__(self) -> int:
        return len(self.registered)
