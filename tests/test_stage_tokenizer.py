"""The CPU stages' tokenizer equals transformers' tokenizer for the same model, and loading it
never imports torch into the stage process."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jobs.model_tokenizer import (
    ModelTokenizer,
    cached_tokenizer_folder,
    load_model_tokenizer,
)
from runtime.model_files import default_gguf_path

TEXTS = [
    "",
    "Hello, world!",
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    " leading space",
    "trailing space ",
    "   runs   of    spaces   ",
    "\ttabs\t\tand\nnewlines\n\n\n",
    "\r\nwindows line ends\r\n",
    "Émile a mangé des crêpes à Besançon — très bon !",
    "東京は日本の首都です。人口は多いです。",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "Emoji: 🎉🚀👩‍👩‍👧 and flags 🇫🇷🇯🇵",
    "math ∑∫√∞ and combining e\u0301",
    "zero\u200bwidth and nbsp\u00a0here",
    "<|im_end|>",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text with <|endoftext|> inside and <|im_start|",
    "def f(x):\n    return x  # comment\n\n\nprint(f(3))",
    "12345678901234567890 3.14159 -42 1e-9",
    "don't won't I'm you're they've it's",
    "Hello , world ! Is it ? yes .",
]

CHATS = {
    "system_and_user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are a poet."},
        {"role": "user", "content": "Write a line about the sea."},
        {"role": "assistant", "content": "Waves fold the light 🌊 into foam."},
        {"role": "user", "content": "Now one in French, s'il vous plaît."},
    ],
    "default_system_prompt": [{"role": "user", "content": "Hi there!"}],
    "extra_key_with_none_value": [{"role": "user", "content": "Hi", "name": None}],
    "special_token_text_in_content": [{"role": "user", "content": "say <|im_end|> please"}],
}

# Exercises what Hub templates use beyond plain jinja: tojson, namespace, loop controls,
# the generation tag, raise_exception and the special-token variables.
HELPERS_TEMPLATE = textwrap.dedent(
    """\
    {{ bos_token }}{% set ns = namespace(count=0) %}
    {% for message in messages %}
    {% if message['role'] not in ['user', 'assistant'] %}
    {{ raise_exception('roles must be user or assistant') }}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if ns.count > 3 %}{% break %}{% endif %}
    {% generation %}{{ message | tojson }}{% endgeneration %}{{ eos_token }}
    {% endfor %}
    {% if add_generation_prompt %}[{{ ns.count }}]{% endif %}"""
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One tokenizer cache for the module: the GGUF's tokenizer is converted once."""
    path = tmp_path_factory.mktemp("streamserve-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STREAMSERVE_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def fresh_process_report(cache_dir):
    """Loads and uses the default tokenizer in a fresh interpreter, converting it (cold)."""
    script = textwrap.dedent(
        """\
        import json, sys, time
        started = time.perf_counter()
        from jobs.model_tokenizer import load_model_tokenizer
        tok = load_model_tokenizer("smollm2-135m-instruct")
        loaded = time.perf_counter() - started
        ids = tok.encode("Hello, world!")
        tok.decode(ids)
        tok.decode_batch([ids], skip_special_tokens=False)
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
        tok.token_texts(ids)
        heavy = [name for name in ("torch", "transformers") if name in sys.modules]
        print(json.dumps({"heavy_modules": heavy, "load_s": loaded}))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stage_tokenizer(fresh_process_report) -> ModelTokenizer:
    tokenizer = load_model_tokenizer("smollm2-135m-instruct")
    assert tokenizer is not None
    return tokenizer


@pytest.fixture(scope="module")
def converted_folder(stage_tokenizer) -> Path:
    return cached_tokenizer_folder(default_gguf_path())


def test_stage_process_never_imports_torch_or_transformers(fresh_process_report):
    assert fresh_process_report["heavy_modules"] == []


def test_gguf_tokenizer_is_converted_once_into_the_cache(cache_dir, converted_folder):
    assert converted_folder.parent == cache_dir / "tokenizers"
    assert (converted_folder / "tokenizer.json").is_file()
    leftovers = [p.name for p in converted_folder.parent.iterdir() if p != converted_folder]
    assert leftovers == []


def test_model_name_is_case_insensitive(stage_tokenizer):
    tokenizer = load_model_tokenizer("SmolLM2-135M-Instruct")
    assert tokenizer is not None
    assert tokenizer.encode("Hello") == stage_tokenizer.encode("Hello")


def test_vocabulary_and_special_ids_match_transformers(stage_tokenizer, default_tokenizer):
    assert stage_tokenizer.vocab_size == len(default_tokenizer)
    assert stage_tokenizer.eos_token_id == default_tokenizer.eos_token_id
    assert stage_tokenizer.bos_token_id == default_tokenizer.bos_token_id
    assert stage_tokenizer.chat_template == default_tokenizer.chat_template


def test_the_vocabulary_grammars_are_built_from_is_transformers(stage_tokenizer, default_tokenizer):
    """The engine builds llguidance's tokenizer from this JSON; llguidance's transformers
    adapter reads the fast tokenizer's backend, unpadded and untruncated."""
    backend = copy.copy(default_tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    assert json.loads(stage_tokenizer.vocabulary_json()) == json.loads(backend.to_str())


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(stage_tokenizer, default_tokenizer, text):
    assert stage_tokenizer.encode(text) == default_tokenizer.encode(text)


def test_encode_batch_matches_encoding_one_by_one(stage_tokenizer, default_tokenizer):
    expected = [default_tokenizer.encode(text) for text in TEXTS]
    assert stage_tokenizer.encode_batch(TEXTS) == expected
    assert stage_tokenizer.encode_batch([]) == []


@pytest.mark.parametrize("name", sorted(CHATS))
def test_chat_template_matches_transformers(stage_tokenizer, default_tokenizer, name):
    messages = CHATS[name]
    text = default_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    expected = default_tokenizer.encode(text, add_special_tokens=False)
    assert stage_tokenizer.apply_chat_template(messages) == expected


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_text_and_length_as_transformers_give_them(
    stage_tokenizer, default_tokenizer, add_generation_prompt
):
    """What code written against transformers' tokenizer asks of the engine's."""
    messages = CHATS[sorted(CHATS)[0]]
    options = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    text = default_tokenizer.apply_chat_template(messages, **options)
    assert stage_tokenizer.apply_chat_template(messages, **options) == text
    assert len(stage_tokenizer) == len(default_tokenizer)


def test_default_system_prompt_is_added_when_none_is_given(stage_tokenizer):
    text = stage_tokenizer.decode(
        stage_tokenizer.apply_chat_template(CHATS["default_system_prompt"]),
        skip_special_tokens=False,
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(stage_tokenizer, default_tokenizer, skip_special_tokens):
    seqs = [default_tokenizer.encode(text) for text in TEXTS]
    seqs += [stage_tokenizer.apply_chat_template(chat) for chat in CHATS.values()]
    expected = [default_tokenizer.decode(s, skip_special_tokens=skip_special_tokens) for s in seqs]
    assert [stage_tokenizer.decode(s, skip_special_tokens) for s in seqs] == expected
    assert stage_tokenizer.decode_batch(seqs, skip_special_tokens) == expected


def test_decode_of_ids_ending_mid_character_matches_transformers(
    stage_tokenizer, default_tokenizer
):
    ids = default_tokenizer.encode("日本語 🎉👩‍👩‍👧 crêpe")
    prefixes = [ids[:n] for n in range(len(ids) + 1)]
    expected = [default_tokenizer.decode(p) for p in prefixes]
    assert any(text.endswith("\ufffd") for text in expected)  # some cut inside a character
    assert stage_tokenizer.decode_batch(prefixes) == expected


def test_token_texts_are_each_token_decoded_alone(stage_tokenizer, default_tokenizer):
    ids = stage_tokenizer.apply_chat_template(CHATS["multi_turn"]) + default_tokenizer.encode(
        "日本語 🎉"
    )
    expected = [default_tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert stage_tokenizer.token_texts(ids) == expected
    assert "<|im_start|>" in expected


def _folder_with_config(src: Path, dst: Path, config: dict) -> Path:
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    base = json.loads((src / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return dst


def test_template_helpers_render_as_in_transformers(converted_folder, tmp_path):
    from transformers import AutoTokenizer

    folder = _folder_with_config(
        converted_folder, tmp_path / "helpers", {"chat_template": HELPERS_TEMPLATE}
    )
    reference = AutoTokenizer.from_pretrained(str(folder))
    tokenizer = load_model_tokenizer(str(folder))
    messages = [
        {"role": "user", "content": 'quote " and é and <tag>', "name": None},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "cut by the loop's break"},
    ]
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.render_chat(messages) == text
    assert '"quote \\" and é and <tag>"' in text  # tojson, with no HTML or ASCII escaping
    assert "name" not in text  # keys whose value is None are dropped before rendering
    assert tokenizer.apply_chat_template(messages) == reference.encode(
        text, add_special_tokens=False
    )
    with pytest.raises(ValueError, match="roles must be user or assistant"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}])


def test_clean_up_spaces_setting_is_ignored_for_bpe_as_in_transformers(converted_folder, tmp_path):
    from transformers import AutoTokenizer

    folder = _folder_with_config(
        converted_folder, tmp_path / "cleanup", {"clean_up_tokenization_spaces": True}
    )
    reference = AutoTokenizer.from_pretrained(str(folder))
    tokenizer = load_model_tokenizer(str(folder))
    ids = reference.encode("Hello , world ! don 't")
    assert tokenizer.decode(ids) == reference.decode(ids) == "Hello , world ! don 't"


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([{"content": "no role"}], r"messages\[0\]: each message needs a 'role'"),
        ([{"role": "user"}], r"messages\[0\]: each message needs a 'role' and a 'content'"),
        (["not a dict"], r"messages\[0\]"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content"),
        ([{"role": 3, "content": "x"}], r"messages\[0\]\.role"),
    ],
)
def test_bad_messages_raise_value_error(stage_tokenizer, messages, error):
    with pytest.raises(ValueError, match=error):
        stage_tokenizer.apply_chat_template(messages)


def test_folder_without_chat_template_rejects_messages(converted_folder, tmp_path):
    folder = tmp_path / "no-template"
    folder.mkdir()
    shutil.copy(converted_folder / "tokenizer.json", folder / "tokenizer.json")
    tokenizer = load_model_tokenizer(str(folder))
    assert tokenizer.chat_template is None
    assert tokenizer.eos_token_id is None  # no tokenizer_config.json names one
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_random_model_has_no_tokenizer():
    assert load_model_tokenizer("random:llama-tiny") is None


def test_missing_path_lists_the_accepted_forms(tmp_path):
    with pytest.raises(ValueError, match="no file or folder.*Accepted: 'smollm2-135m-instruct'"):
        load_model_tokenizer(str(tmp_path / "nowhere"))


def test_folder_without_tokenizer_json_is_named(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError, match="folder without tokenizer.json"):
        load_model_tokenizer(str(tmp_path))


def test_file_that_is_not_gguf_is_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_model_tokenizer(str(path))


def test_failed_conversion_quotes_the_child_error_and_leaves_no_folder(cache_dir, tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(
        RuntimeError, match=r"converting the tokenizer of .*broken\.gguf failed"
    ) as err:
        load_model_tokenizer(str(path))
    assert "Error:" in str(err.value)  # the last line of the child's traceback
    assert not cached_tokenizer_folder(path).exists()
    assert not list((cache_dir / "tokenizers").glob(".broken-*"))


@pytest.mark.parametrize(("preset", "expected"), [(None, "false"), ("true", "true")])
def test_the_stage_tokenizer_turns_the_libraries_thread_pool_off_unless_told(preset, expected):
    # Its batch calls' thread pool cost a detokenizer 2.6x the CPU a token on 16 cores.
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    if preset is not None:
        env["TOKENIZERS_PARALLELISM"] = preset
    code = ("import os, jobs.model_tokenizer; "
            "print(os.environ['TOKENIZERS_PARALLELISM'])")  # fmt: skip
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, check=True).stdout.strip()  # fmt: skip
    assert found == expected
