"""What a CPU stage's start imports: `up` starts four stages, the tests start hundreds, and
each module a stage loads is paid at every start. numpy (~0.15 s to import here) packs the
worker's and the ingress's vectors; llguidance (~0.06 s) compiles a grammar, on the first
request that asks for structure. The router, tokenizer and detokenizer start without both
(and without torch or transformers, which tests/test_layout.py keeps out of their source)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

STAGE_MODULES = ("stages.router.stage", "stages.tokenizer.stage", "stages.detokenizer.stage")
DEFERRED = ("numpy", "llguidance", "torch", "transformers")


def _loaded_after_importing(*modules: str) -> list[str]:
    script = (
        f"import json, sys, cli.main, cli.run_stage, {', '.join(modules)}\n"
        f"print(json.dumps([m for m in {DEFERRED!r} if m in sys.modules]))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent.parent, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_the_router_tokenizer_and_detokenizer_start_without_numpy_or_llguidance():
    assert _loaded_after_importing(*STAGE_MODULES) == []


def test_a_grammar_compiles_where_llguidance_was_not_imported_at_start():
    from jobs.grammar import grammar_problem

    assert grammar_problem("regex", "[0-9]+") is None
    assert "does not compile" in grammar_problem("regex", "[0-9")


def test_block_hashes_are_those_of_the_int32_little_endian_tokens():
    # The router's and the workers' names for a prefix must agree across versions: the hash
    # of the wire's bytes, as numpy's "<i4" gave them before the standard library's array.
    import hashlib

    from jobs.kv_blocks import ROOT_HASH, block_hashes

    ids = [1, 70_000, 2**31 - 1, 0, 5, 6]
    raw = b"".join(i.to_bytes(4, "little", signed=True) for i in ids[:4])
    first = hashlib.blake2b(ROOT_HASH.to_bytes(8, "little") + raw, digest_size=8).digest()
    assert block_hashes(ids, 4) == [int.from_bytes(first, "little")]
