"""Tensor parallelism (gpu_worker/parallel): greedy float32 tokens under tp 2 equal tp 1's
and transformers', each rank holds only its share, a bad tp is refused at start, and the
ranks of a worker live and die as one. Two ranks over gloo on CPU."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers

from gpu_worker import Engine
from gpu_worker.hf_reference import hf_greedy
from gpu_worker.parallel.launch import EXIT_RANK_DIED

# The same tiny Llama, Qwen2 and Mistral as the single-rank anchor: a wide init makes the
# logits peaked, so the ranks' different summation order cannot flip a greedy choice.
from tests.test_engine_tiny_models import MODELS, VOCAB

MAX_NEW = 16
POOL = {"max_total_tokens": 4096}  # small: each rank zeroes its own pool at start
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


def _save_tiny(name: str, path, **changes):
    torch.manual_seed(0)
    config = MODELS[name]()
    for key, value in changes.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if name == "qwen2":  # non-zero q/k/v biases, so their shares are tested too
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                             layer.self_attn.v_proj):  # fmt: skip
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def tiny_model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _save_tiny(request.param, path)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 12, 33, 70)]
    prompts.append(prompts[-1][:40] + [rng.randrange(VOCAB) for _ in range(20)])
    return prompts


def _greedy(model: str, prompts, **options) -> list[list[int]]:
    with Engine(model, dtype="float32", **POOL, **options) as engine:
        results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    return [r["output_ids"] for r in results]


def _report_hooks(out_dir) -> list[dict]:
    """A hook on every rank writing the shapes it holds to out_dir/rank<r>.json."""
    report = {"dir": str(out_dir)}
    return [{"name": "report", "target_modules": ["model"],
             "hook_factory": "tests.tp_probe:report_shard", "config": report}]  # fmt: skip


def test_tp2_greedy_equals_tp1_and_transformers(tiny_model, tmp_path):
    name, path, hf_model = tiny_model
    prompts = _prompts()
    reference = hf_greedy(hf_model, prompts, MAX_NEW, stop_at_eos=False)
    hooks = _report_hooks(tmp_path)
    assert _greedy(str(path), prompts) == reference
    assert _greedy(str(path), prompts, tp=2, forward_hooks=hooks) == reference
    # Each rank held only its share: half the heads, MLP columns and vocabulary rows.
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[1]["pid"] != ranks[0]["pid"] == os.getpid()
    head_dim = 16
    for report in ranks:
        shapes = report["shapes"]
        assert shapes["embed_tokens.weight"] == [VOCAB // 2, 96]
        assert shapes["layers.0.self_attn.qkv_proj.weight"] == [(3 + 2 * 1) * head_dim, 96]
        assert shapes["layers.0.self_attn.o_proj.weight"] == [96, 3 * head_dim]
        assert shapes["layers.0.mlp.gate_up_proj.weight"] == [2 * 96, 96]
        assert shapes["layers.0.mlp.down_proj.weight"] == [96, 96]
        assert shapes["norm.weight"] == [96]  # replicated
    assert not multiprocessing.active_children()  # shutdown ended the follower


def test_tp2_with_prefix_cache_chunks_and_ngram_speculation(tmp_path):
    # A narrower, tied init: this model repeats itself, so n-gram drafts are found and some
    # hold (the wide-init models never repeat in a few dozen tokens).
    hf_model = _save_tiny("llama", tmp_path, initializer_range=0.08, tie_word_embeddings=True)
    rng = random.Random(1)
    # The shared 40 tokens give the prefix cache hits, and 8-token chunks split every prompt.
    period = [rng.randrange(VOCAB) for _ in range(5)]
    prompts = [period * 8, period * 8 + [rng.randrange(VOCAB) for _ in range(9)], [7, 8, 9]]
    reference = hf_greedy(hf_model, prompts, MAX_NEW, stop_at_eos=False)
    options = {"chunked_prefill_size": 8, "page_size": 4, "speculative": "ngram",
               "speculative_verify": "always", "tp": 2}  # fmt: skip
    with Engine(str(tmp_path), dtype="float32", **POOL, **options) as engine:
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        second = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert engine.scheduler.drafter.accepted > 0  # drafts were verified, some held
    assert [r["output_ids"] for r in first] == reference
    assert [r["output_ids"] for r in second] == reference
    # (The 3-token prompt fills no whole page, so nothing of it is cached.)
    assert all(r["usage"]["cached_tokens"] > 0 for r in second[:2])


def test_tp2_retracts_and_still_matches():
    prompts = [[3, 4, 5, 6] * 5, [9, 10, 11] * 6, [1] * 17, [2, 7] * 9]
    # Room for about two requests at once: decode retracts and recomputes the others.
    options = {"max_total_tokens": 80, "page_size": 4}
    with Engine("random:tiny-qwen2", dtype="float32", **options) as engine:
        single = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    with Engine("random:tiny-qwen2", dtype="float32", tp=2, **options) as engine:
        split = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert engine.scheduler.num_retractions > 0
    assert [r["output_ids"] for r in split] == [r["output_ids"] for r in single]


def test_tp2_forward_hooks_change_every_rank_alike():
    hooks = [{"name": "steer", "target_modules": ["model.layers.0"],
              "hook_factory": "tests.tp_probe:steer", "config": {"amount": 0.05}}]  # fmt: skip
    prompts = [[5, 6, 7, 8], [40, 41]]
    plain = _greedy("random:tiny-mistral", prompts)
    steered = _greedy("random:tiny-mistral", prompts, forward_hooks=hooks)
    assert steered != plain  # the hook changes the output ...
    assert _greedy("random:tiny-mistral", prompts, tp=2, forward_hooks=hooks) == steered


def test_default_model_tp2_equals_transformers(hf_default_model, default_tokenizer, tmp_path):
    # SmolLM2-135M has 3 key/value heads: rank 0 holds two, rank 1 one (an uneven split).
    texts = [
        default_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        for q in ("What is the capital of France?", "List three prime numbers.")
    ]
    prompts = [default_tokenizer.encode(text, add_special_tokens=False) for text in texts]
    reference = hf_greedy(hf_default_model, prompts, 12)
    # A grammar is rank 0's alone (it masks the gathered logits): the same tokens either way.
    schema = {"temperature": 0, "max_new_tokens": 24, "regex": "(Paris|London), [0-9]+[.]"}
    budget = {"kv_cache_memory_gb": 0.01, "forward_hooks": _report_hooks(tmp_path)}
    with Engine("smollm2-135m-instruct", dtype="float32", tp=2, **budget) as engine:
        results = engine.generate(
            input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 12}
        )
        constrained = engine.generate(input_ids=prompts[0], sampling_params=schema)
    assert [r["output_ids"] for r in results] == reference
    with Engine("smollm2-135m-instruct", dtype="float32", **POOL) as engine:
        single = engine.generate(input_ids=prompts[0], sampling_params=schema)
    assert constrained["output_ids"] == single["output_ids"]
    assert re.fullmatch("(Paris|London), [0-9]+[.]", constrained["text"])
    # The KV pool is the smaller rank's: rank 0's two heads a slot fit fewer slots in the
    # same budget than rank 1's one, and both pools have that many.
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    rank0_slots = int(0.01 * 2**30) // (2 * 30 * 2 * 64 * 4)  # K and V, layers, heads, dim, fp32
    assert [r["kv_slots"] for r in ranks] == [rank0_slots, rank0_slots]
    qkv = "layers.0.self_attn.qkv_proj.weight"
    assert [r["shapes"][qkv][0] for r in ranks] == [(6 + 2 * 2) * 64, (3 + 2 * 1) * 64]


@pytest.mark.parametrize(
    "tp, message",
    [
        (0, "tp must be a positive"),
        (-2, "tp must be a positive"),
        (3, "exceeds the model's 2 key/value heads"),
    ],  # fmt: skip
)
def test_bad_tp_is_refused_at_start(tp, message):
    started = time.monotonic()
    with pytest.raises(ValueError, match=message):
        Engine("random:tiny-llama", tp=tp)
    assert time.monotonic() - started < 10  # an error, not a hang
    assert not multiprocessing.active_children()  # nothing was started


def _serving_process() -> tuple[subprocess.Popen, int]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.tp_probe", "serve"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    follower_pid = int(process.stdout.readline())
    time.sleep(1)  # serving by now
    return process, follower_pid


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_killed_follower_takes_rank0_down():
    process, follower = _serving_process()
    os.kill(follower, signal.SIGKILL)
    try:
        code = process.wait(timeout=30)
    finally:
        process.kill()
    assert code == EXIT_RANK_DIED
    assert "tp-rank-1 died" in process.stderr.read()


def test_a_forward_that_raises_ends_the_worker_as_one():
    # Once the followers have a step, rank 0 cannot take its failure for the batch's alone.
    process = subprocess.run([sys.executable, "-m", "tests.tp_probe", "raise"],
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert process.returncode == EXIT_RANK_DIED, process.stderr[-2000:]
    assert "the worker exits as one" in process.stderr


def test_a_killed_rank0_takes_the_follower_down():
    process, follower = _serving_process()
    process.kill()
    process.wait()
    assert _gone(follower, within_s=30)


def test_tp2_draft_speculation_embeddings_and_logprobs_equal_tp1():
    prompts = [[3, 4, 5, 6] * 4, [100, 7, 250, 9, 11]]
    sampling = {**GREEDY, "logprobs": True, "prompt_logprobs": True}
    options = {"speculative": "draft", "draft_model": "random:nano-llama",
               "speculative_verify": "always"}  # fmt: skip
    results = {}
    for tp in (1, 2):
        with Engine("random:tiny-llama", dtype="float32", tp=tp, **POOL, **options) as engine:
            generated = engine.generate(input_ids=prompts, sampling_params=sampling)
            vectors = engine.embed(input_ids=prompts)
            results[tp] = (generated, torch.tensor(vectors))
    (single, single_vectors), (split, split_vectors) = results[1], results[2]
    assert [r["output_ids"] for r in split] == [r["output_ids"] for r in single]
    assert all(r["usage"]["draft_tokens"] > 0 for r in split)  # drafts were verified
    for a, b in zip(single, split, strict=True):
        assert torch.allclose(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-4)
        prompt_a, prompt_b = (torch.tensor(r["prompt_logprobs"][1:]) for r in (a, b))
        assert torch.allclose(prompt_a, prompt_b, atol=1e-4)
    assert torch.allclose(single_vectors, split_vectors, atol=1e-5)


def test_tp2_over_gloo_equals_tp1(monkeypatch):
    # CPU ranks reduce through shared memory by default; gloo is what is left without it.
    monkeypatch.setenv("STREAMSERVE_TP_SHARED_MEMORY", "0")  # inherited by the follower
    prompts = [[5, 6, 7, 8, 9, 10], [40, 41]]
    with Engine("random:tiny-qwen2", dtype="float32", tp=2, **POOL) as engine:
        assert engine.runner.tp_leader.group.shared is None
        split = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in split] == _greedy("random:tiny-qwen2", prompts)


def test_a_tp2_worker_refuses_a_weights_update_and_serves_on():
    # Each rank would have to load its share: not built, so the update fails with the reason
    # (the heartbeat reports it) and the worker keeps serving what it served.
    from gpu_worker.weights_update import WeightsUpdates

    weights = WeightsUpdates("w", "w0-aaaa")
    weights.noticed({b"source": b"random:tiny-llama", b"version": b"w1-bbbb"})
    with Engine("random:tiny-llama", dtype="float32", tp=2) as engine:
        before = engine.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)[0]["output_ids"]
        update = weights.apply(engine, weights.due())
        assert not update.ok and "tensor parallelism" in update.error
        assert weights.version == "w0-aaaa" and weights.error.startswith("w1-bbbb: ")
        after = engine.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)[0]["output_ids"]
    assert after == before
