"""The shared workloads of shared/BENCHMARKS.md as token-id prompts and output lengths.

Token ids come from random.Random(seed) in [100, 40000). Draw order, per request: the prompt
length (where it varies), the output length (where it varies), then the prompt's ids; the
shared prefix is drawn first. Every system measured gets these same lists.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

LOW_ID, HIGH_ID = 100, 40000


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW_ID, HIGH_ID) for _ in range(n)]


def make_workload(name: str, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    if name == "single":
        return Workload(name, [_ids(rng, 128)], [256])
    if name == "uniform-64":
        return Workload(name, [_ids(rng, 256) for _ in range(64)], [128] * 64)
    if name == "mixed-64":
        prompts, outs = [], []
        for _ in range(64):
            prompt_len = rng.randint(32, 512)
            outs.append(rng.randint(16, 256))
            prompts.append(_ids(rng, prompt_len))
        return Workload(name, prompts, outs)
    if name == "shared-prefix":
        prefix = _ids(rng, 1024)
        return Workload(name, [prefix + _ids(rng, 32) for _ in range(64)], [64] * 64)
    raise ValueError(f"unknown workload {name!r}; known: {WORKLOADS}")


WORKLOADS = ["single", "uniform-64", "mixed-64", "shared-prefix"]

# `copy`: real text the model is asked to repeat, where n-gram drafts are mostly right.
COPY_MODULES = ["json", "argparse", "itertools", "collections", "heapq", "csv", "tempfile",
                "string", "random", "statistics", "difflib", "typing", "unittest", "inspect",
                "subprocess", "uuid"]  # fmt: skip
COPY_INSTRUCTION = "Repeat the following text exactly, without any comment:\n\n"
COPY_PASSAGE_CHARS = 600
COPY_MAX_NEW_TOKENS = 256


def copy_messages() -> list[list[dict[str, str]]]:
    """One chat per module: the first 600 characters of its docstring, cut back to the last
    space, after the instruction to repeat it."""
    import importlib

    chats = []
    for name in COPY_MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        passage = doc[:COPY_PASSAGE_CHARS]
        if len(doc) > COPY_PASSAGE_CHARS:
            passage = passage.rsplit(" ", 1)[0]
        chats.append([{"role": "user", "content": COPY_INSTRUCTION + passage}])
    return chats
