"""Every input a caller can get wrong is a ValueError naming the field, never a crash."""

from __future__ import annotations

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.config import EngineConfig, cpu_has_native_bfloat16


@pytest.fixture(scope="module")
def tiny():
    return Engine("random:tiny-llama", dtype="float32")


@pytest.mark.parametrize(
    "params, field",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 3.0}, "frequency_penalty"),
        ({"presence_penalty": -3.0}, "presence_penalty"),
        ({"min_new_tokens": 50, "max_new_tokens": 10}, "min_new_tokens"),
        ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
        ({"temprature": 0.5}, "temprature"),
    ],
)
def test_out_of_range_sampling_parameter_names_the_field(tiny, params, field):
    with pytest.raises(ValueError, match=field):
        tiny.generate(input_ids=[1, 2, 3], sampling_params=params)


def test_empty_prompt_is_rejected(tiny):
    with pytest.raises(ValueError, match="input_ids"):
        tiny.generate(input_ids=[])
    with pytest.raises(ValueError, match="input_ids"):
        tiny.generate(input_ids=[[1, 2], []])


def test_token_id_outside_the_vocabulary_is_rejected(tiny):
    with pytest.raises(ValueError, match="token id"):
        tiny.generate(input_ids=[1, tiny.vocab_size])


def test_prompt_plus_max_new_tokens_beyond_context_is_rejected(tiny):
    context = tiny.runner.context_length
    with pytest.raises(ValueError, match="context length") as caught:
        tiny.generate(input_ids=[1] * (context - 5), sampling_params={"max_new_tokens": 10})
    assert (caught.value.field, caught.value.code) == ("max_new_tokens", "context_length_exceeded")


def test_text_prompt_without_a_tokenizer_is_rejected(tiny):
    with pytest.raises(ValueError, match="tokenizer"):
        tiny.generate("hello")


def test_exactly_one_kind_of_prompt(tiny):
    with pytest.raises(ValueError, match="exactly one"):
        tiny.generate()
    with pytest.raises(ValueError, match="exactly one"):
        tiny.generate("hi", input_ids=[1])


def test_params_list_must_match_prompts(tiny):
    with pytest.raises(ValueError, match="sampling_params"):
        tiny.generate(input_ids=[[1], [2]], sampling_params=[{}])


def test_bad_input_leaves_the_engine_working(tiny):
    with pytest.raises(ValueError):
        tiny.generate(input_ids=[[1, 2], [3, 10**9]])
    assert not tiny.scheduler.has_work()
    out = tiny.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert len(out["output_ids"]) == 3


@pytest.mark.parametrize(
    "options, field",
    [
        ({"model": "no-such-model"}, "no-such-model"),
        ({"model": "random:no-such-shape"}, "no-such-shape"),
        ({"model": "random:tiny-llama", "dtype": "float8"}, "dtype"),
        ({"model": "random:tiny-llama", "page_size": 0}, "page_size"),
        ({"model": "random:tiny-llama", "schedule_policy": "random"}, "schedule_policy"),
        ({"model": "random:tiny-llama", "max_batch": 3}, "max_batch"),
        ({"model": "random:tiny-llama", "attention_backend": "magic"}, "attention_backend"),
        ({"model": "random:tiny-llama", "device": "tpu:7"}, "device"),
    ],
)
def test_bad_engine_option_names_it(options, field):
    with pytest.raises(ValueError, match=field):
        Engine(**options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA"):
        Engine("random:tiny-llama", device="cuda")


def test_auto_dtype_is_bfloat16_only_where_the_cpu_runs_it_natively():
    config = EngineConfig(model="random:tiny-llama", device="cpu")
    expected = torch.bfloat16 if cpu_has_native_bfloat16() else torch.float32
    assert config.torch_dtype() == expected
    assert EngineConfig(model="random:tiny-llama", dtype="bfloat16").torch_dtype() == torch.bfloat16
