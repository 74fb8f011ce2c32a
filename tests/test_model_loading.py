"""Model resolution, GGUF conversion, HF folders, random shapes and ModelConfig parsing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from gpu_worker.models.config import ModelConfig
from gpu_worker.models.gguf_convert import convert_gguf
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.loader import LoadedModel, load_model
from gpu_worker.models.random_shapes import RANDOM_SHAPES, random_shape_config
from runtime.model_files import default_gguf_path
from tests.tiny_configs import llama3_rope, tiny_shape


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("streamserve-cache")


@pytest.fixture(scope="module")
def converted(cache_dir: Path) -> Path:
    return convert_gguf(default_gguf_path(), cache_dir)


@pytest.fixture(scope="module")
def loaded_default(converted: Path, cache_dir: Path) -> LoadedModel:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STREAMSERVE_CACHE", str(cache_dir))
        return load_model("SmolLM2-135M-Instruct", torch.float32, "cpu")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


def tiny_hf_config(model_type: str = "llama", **overrides) -> transformers.PretrainedConfig:
    """A transformers config of `model_type` in the one small shape every test here builds."""
    shape = tiny_shape(128, 32, 64, layers=2, heads=4, kv_heads=2)
    return transformers.AutoConfig.for_model(model_type, **shape, **overrides)


def tiny_hf_llama(tie: bool = False) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = tiny_hf_config(tie_word_embeddings=tie)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


# --- GGUF conversion of the default model ---------------------------------------------


@pytest.mark.slow
def test_gguf_conversion_gives_the_state_dict_of_transformers_gguf_loader(
    converted: Path, hf_default_model: torch.nn.Module
) -> None:
    ours = read_safetensors(converted / "model.safetensors")
    reference = hf_default_model.state_dict()

    # Tied: transformers lists lm_head.weight as an alias of the embedding; we do not store it.
    assert set(reference) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(reference)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), f"{name} differs"


@pytest.mark.slow
def test_converted_folder_loads_in_transformers(converted: Path) -> None:
    config = transformers.AutoConfig.from_pretrained(converted)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


@pytest.mark.slow
def test_second_conversion_reuses_the_cached_folder(converted: Path, cache_dir: Path) -> None:
    before = (converted / "model.safetensors").stat()

    again = convert_gguf(default_gguf_path(), cache_dir)

    after = (again / "model.safetensors").stat()
    assert again == converted
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert [p.name for p in cache_dir.iterdir()] == [converted.name]  # no temp dirs left


@pytest.mark.slow
def test_default_model_name_loads_from_the_cache_with_fused_weights(
    loaded_default: LoadedModel, converted: Path
) -> None:
    model = loaded_default.model
    assert str(converted) in loaded_default.source
    weights = read_safetensors(converted / "model.safetensors")
    attn = model.model.layers[3].self_attn
    expected_qkv = torch.cat(
        [weights[f"model.layers.3.self_attn.{p}_proj.weight"] for p in ("q", "k", "v")]
    )
    assert torch.equal(attn.qkv_proj.weight, expected_qkv)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any(p.requires_grad for p in model.parameters())
    assert not model.training


@pytest.mark.slow
def test_tokenizer_and_chat_template_come_through(
    loaded_default: LoadedModel, default_tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    tokenizer = loaded_default.tokenizer
    reader = gguf.GGUFReader(default_gguf_path())
    assert tokenizer is not None
    assert tokenizer.chat_template == reader.fields["tokenizer.chat_template"].contents()
    text = "Hello, world! Ünïcode and   spaces."
    assert tokenizer.encode(text) == default_tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.render_chat(messages).endswith("<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(messages) == default_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tokenizer.eos_token_id == default_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id in loaded_default.config.eos_token_ids


@pytest.mark.slow
def test_an_engine_on_the_default_model_starts_without_transformers_or_sympy(
    converted: Path, cache_dir: Path
) -> None:
    """The model's tokenizer is jobs/model_tokenizer.py's and its meta weights are allocated
    with torch.empty: transformers' tokenizer (~1.7 s) and the decompositions that
    `Module.to_empty` imports (~0.3 s) were most of a worker's start."""
    code = (
        "import sys\n"
        "from gpu_worker import Engine\n"
        "engine = Engine('SmolLM2-135M-Instruct', dtype='float32')\n"
        "out = engine.generate('Hi', {'max_new_tokens': 4, 'temperature': 0, 'stop': ['zz']})\n"
        "heavy = sorted({'transformers', 'sympy'} & set(sys.modules))\n"
        "print(heavy, engine.tokenizer.eos_token_id)\n"
    )
    env = {**os.environ, "STREAMSERVE_CACHE": str(cache_dir)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["[]", "2"], done.stdout


def test_failed_conversion_leaves_nothing_in_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cache = tmp_path / "cache"

    with pytest.raises(ValueError, match="'gpt2'"):
        convert_gguf(path, cache)

    assert list(cache.iterdir()) == []


# --- name resolution ----------------------------------------------------------------------


def test_unknown_model_name_raises_naming_it_and_the_accepted_forms() -> None:
    with pytest.raises(ValueError, match="no-such-model") as info:
        load_model("no-such-model", torch.float32, "cpu")
    assert "random:<shape>" in str(info.value) and ".gguf" in str(info.value)


def test_unknown_random_shape_raises_listing_known_shapes() -> None:
    with pytest.raises(ValueError, match="no-such-shape") as info:
        load_model("random:no-such-shape", torch.float32, "cpu")
    assert "tiny-llama" in str(info.value) and "llama-3.1-8b" in str(info.value)


def test_random_weights_are_deterministic_per_seed() -> None:
    a = load_model("random:tiny-qwen2", torch.float32, "cpu", seed=0)
    b = load_model("random:tiny-qwen2", torch.float32, "cpu", seed=0)
    c = load_model("random:tiny-qwen2", torch.float32, "cpu", seed=1)

    state_a, state_b, state_c = (m.model.state_dict() for m in (a, b, c))
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert not torch.equal(
        state_a["model.embed_tokens.weight"], state_c["model.embed_tokens.weight"]
    )
    assert a.tokenizer is None and a.source.startswith("random:tiny-qwen2")


def test_random_shapes_load_in_the_requested_dtype() -> None:
    loaded = load_model("random:tiny-llama", torch.bfloat16, "cpu")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_real_random_shapes_have_the_published_sizes() -> None:
    config = random_shape_config("llama-3.1-8b")
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        32,
        4096,
        14336,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (
        32,
        8,
        128256,
    )
    assert config.rope_theta == 500000.0 and config.max_position_embeddings == 131072
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert random_shape_config("qwen2-0.5b").attention_bias is True
    assert random_shape_config("smollm2-135m").tie_word_embeddings is True
    assert {"tiny-llama", "tiny-qwen2", "tiny-mistral", "llama-3.2-1b"} <= set(RANDOM_SHAPES)


# --- HF folders and load_weights ------------------------------------------------------------


def test_sharded_hf_folder_loads(tmp_path: Path) -> None:
    hf_model = tiny_hf_llama()
    hf_model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()

    loaded = load_model(str(tmp_path), torch.float32, "cpu")

    hf = hf_model.state_dict()
    mlp = loaded.model.model.layers[1].mlp
    gate_up = torch.cat(
        [hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]]
    )
    assert torch.equal(mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(loaded.model.lm_head.weight, hf["lm_head.weight"])
    assert loaded.tokenizer is None


def test_load_weights_rejects_an_unexpected_tensor_name() -> None:
    hf_model = tiny_hf_llama()
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    model = LlamaForCausalLM.empty(config, torch.float32, "cpu")
    weights = dict(hf_model.state_dict())
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # skipped
    weights["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)

    with pytest.raises(ValueError, match="q_norm"):
        model.load_weights(weights.items())


def test_load_weights_rejects_a_missing_shard() -> None:
    hf_model = tiny_hf_llama(tie=True)
    config = ModelConfig.from_hf_dict(hf_model.config.to_dict())
    model = LlamaForCausalLM.empty(config, torch.float32, "cpu")
    weights = dict(hf_model.state_dict())
    del weights["model.layers.1.mlp.up_proj.weight"]

    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.gate_up_proj\.weight"):
        model.load_weights(weights.items())


# --- ModelConfig ----------------------------------------------------------------------------

HF_CONFIGS = {
    "llama3": lambda: tiny_hf_config(
        "llama",
        eos_token_id=[2, 7],
        rope_parameters=llama3_rope(500000.0, factor=32.0, original_context=8192),
    ),
    "qwen2": lambda: tiny_hf_config("qwen2", tie_word_embeddings=True),
    "mistral": lambda: tiny_hf_config("mistral", head_dim=32, sliding_window=None),
}


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_config_round_trips_through_transformers(name: str) -> None:
    hf_config = HF_CONFIGS[name]()
    config = ModelConfig.from_hf_dict(hf_config.to_dict())

    d = config.to_hf_dict()
    rebuilt = transformers.AutoConfig.for_model(d.pop("model_type"), **d)

    assert ModelConfig.from_hf_dict(rebuilt.to_dict()) == config
    assert rebuilt.rope_parameters == hf_config.rope_parameters
    assert type(rebuilt) is type(hf_config)
    assert config.attention_bias is (name == "qwen2")


def test_config_reads_transformers4_rope_keys() -> None:
    d = HF_CONFIGS["llama3"]().to_dict()
    scaling = d.pop("rope_parameters")
    d["rope_theta"] = scaling.pop("rope_theta")
    d["rope_scaling"] = {"type": scaling.pop("rope_type"), **scaling}

    config = ModelConfig.from_hf_dict(d)

    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {"rope_type": "llama3", **scaling}
    assert config.eos_token_ids == (2, 7)


def test_unsupported_rope_scaling_raises_naming_it() -> None:
    d = HF_CONFIGS["mistral"]().to_dict()
    d["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(ValueError, match="'yarn'"):
        ModelConfig.from_hf_dict(d)


def test_unsupported_architecture_lists_supported_ones() -> None:
    d = HF_CONFIGS["mistral"]().to_dict() | {"architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as info:
        ModelConfig.from_hf_dict(d)
    assert "Qwen2ForCausalLM" in str(info.value)


def test_heads_that_do_not_group_are_rejected() -> None:
    d = HF_CONFIGS["mistral"]().to_dict() | {"num_key_value_heads": 3}
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_dict(d)


def test_building_a_model_runs_no_op_on_the_meta_device_that_imports_torch_dynamo():
    """A model is built on the meta device and then allocated (LlamaForCausalLM.empty); an
    op on meta tensors there (an init, the rotary frequencies) imported torch._dynamo, 0.3-0.4
    s of every worker's start."""
    script = (
        "import sys\n"
        "from gpu_worker import Engine\n"
        "Engine('random:tiny-llama', dtype='float32', max_total_tokens=64)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "False"
