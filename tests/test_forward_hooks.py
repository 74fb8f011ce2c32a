from __future__ import annotations

import logging

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.models.random_shapes import fill_random_weights
from tests import hook_factories

MODEL = "random:tiny-llama"
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


def _hook(factory: str, targets="model.layers.*.mlp", **config):
    return {
        "name": factory.rsplit(":", 1)[-1],
        "target_modules": targets,
        "hook_factory": factory,
        "config": config,
    }


def test_hook_runs_on_every_matched_module_and_can_be_removed():
    spec = _hook("tests.hook_factories:count_calls", key="mlp")
    engine = Engine(MODEL, forward_hooks=[spec])
    layers = engine.runner.model_config.num_hidden_layers
    assert len(engine.runner.forward_hooks) == layers
    engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    assert hook_factories.CALLS["mlp"] == layers * 4  # one prefill + three decode forwards
    assert engine.runner.forward_hooks.remove("count_calls") == layers
    engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    assert hook_factories.CALLS["mlp"] == layers * 4


def test_hook_can_change_the_output():
    spec = _hook("tests.hook_factories.force_token", targets="lm_head", token=7)
    engine = Engine(MODEL, forward_hooks=[spec])
    out = engine.generate(input_ids=[1, 2, 3], sampling_params=GREEDY)
    assert out["output_ids"] == [7, 7, 7, 7]


@pytest.mark.parametrize(
    "factory, message",
    [
        ("no-dots-or-colon", "malformed"),
        ("tests.hook_factories:missing", "has no attribute 'missing'"),
        ("tests.no_such_module:count_calls", "cannot import"),
        ("tests.hook_factories:NOT_CALLABLE", "not callable"),
    ],
)
def test_bad_hook_factory_path_fails_startup(factory, message):
    with pytest.raises(ValueError, match=message):
        Engine(MODEL, forward_hooks=[_hook(factory)])


def test_hook_spec_missing_field_fails_startup():
    with pytest.raises(ValueError, match="missing 'hook_factory'"):
        Engine(MODEL, forward_hooks=[{"name": "x", "target_modules": ["lm_head"]}])


def test_hook_matching_nothing_only_warns(caplog):
    spec = _hook("tests.hook_factories:count_calls", targets="no.such.module*", key="none")
    with caplog.at_level(logging.WARNING):
        engine = Engine(MODEL, forward_hooks=[spec])
    assert len(engine.runner.forward_hooks) == 0
    assert "matched no module" in caplog.text


def test_factory_returning_none_only_warns(caplog):
    with caplog.at_level(logging.WARNING):
        engine = Engine(MODEL, forward_hooks=[_hook("tests.hook_factories:returns_none")])
    assert len(engine.runner.forward_hooks) == 0
    assert "returned None" in caplog.text


@pytest.mark.parametrize("layer", [0, 1])  # tiny-llama has two: before and after a fused one
def test_hooked_decoder_layer_sees_its_whole_output(layer):
    """Unhooked layers leave their MLP's residual add to the next norm; a hooked layer returns
    the summed hidden state, so a hook that only observes it changes no token (float32: the
    sum and the norm round alike either way) and one that adds to it changes them."""
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    target = f"model.layers.{layer}"

    def greedy(*hooks):
        engine = Engine(MODEL, dtype="float32", forward_hooks=list(hooks))
        # Wide weights: every part of each layer's output moves the tokens.
        fill_random_weights(engine.runner.model, seed=0, std=0.2)
        outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        return [out["output_ids"] for out in outputs]

    plain = greedy()
    assert greedy(_hook("tests.hook_factories:count_calls", target, key="layer")) == plain
    assert hook_factories.CALLS["layer"] == 4  # one prefill + three decode forwards
    assert greedy(_hook("tests.tp_probe:steer", target, amount=1.0)) != plain


@pytest.mark.parametrize(
    "targets",
    [
        "model.layers.*.self_attn.o_proj",
        "model.layers.*.self_attn",
        "model.layers.*.mlp.down_proj",
        "model.layers.*.mlp",
        "model.layers.*.input_layernorm",
        "model.layers.*.post_attention_layernorm",
        "model.embed_tokens",
        "model.layers.0",
    ],
)
def test_tensors_a_hook_keeps_are_not_written_over(targets):
    """The decoder layers' norms write their sums and outputs over the layer's own
    intermediates (on CPU kernels): never over one a hook has seen. Tokens stay those of
    the model without hooks."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [9, 8, 7]]
    hook_factories.KEPT.pop("kept", None)

    def greedy(*hooks):
        engine = Engine(MODEL, dtype="float32", forward_hooks=list(hooks))
        assert engine.runner.cpu_kernels is not None or not hooks
        fill_random_weights(engine.runner.model, seed=0, std=0.2)
        outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        return [out["output_ids"] for out in outputs]

    plain = greedy()
    assert greedy(_hook("tests.hook_factories:keep_outputs", targets, key="kept")) == plain
    kept = hook_factories.KEPT["kept"]
    assert kept
    for output, copy in kept:
        assert torch.equal(output, copy)
