"""A model's tokenizer: Hugging Face tokenizer files read without torch or transformers.

`transformers` imports torch, which the CPU stages must not, and costs a GPU worker ~1.7 s
of its start (its import and `AutoTokenizer`), so both sides read a tokenizer folder
(tokenizer.json + tokenizer_config.json + chat template) with the Rust `tokenizers` library
and render chat templates with jinja2 the way transformers does. Outputs equal those of
transformers' fast tokenizer loaded from the same folder (tests/test_stage_tokenizer.py).
The tokenizer stage encodes with it, the detokenizer decodes, and the engine finds stop
strings, builds grammars' vocabularies and reads its own text prompts with it: one
implementation, so a worker's text and the detokenizer's agree.

The model argument is resolved as the GPU worker's loader resolves it (runtime/model_files.py):
a random:<shape> model has no tokenizer (None) and takes token ids only, a GGUF file's
tokenizer is converted once in a child process and cached, and a folder needs tokenizer.json.

The `tokenizers` library runs a batch call (``decode_batch``, ``encode_batch``) on a thread
pool of one thread per core. A stage's batches are small (a detokenizer's: a few ids for
each of a publish's requests), so those threads cost more CPU than they save, waking and
spinning: on a 16-core Xeon the detokenizer spent 17-20 CPU-µs a token under load against
7-8 on a 2-core host, and its batch work alone 6.95 µs a token against 1.65 without the
pool (`benchmarks/NOTES.md`, 2026-11-26 evening). A stage scales by replicas, a core each,
so this turns the pool off (``TOKENIZERS_PARALLELISM=false``) unless the environment says
otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jobs.chat_messages import template_error, template_input
from runtime.model_files import build_once, cached_folder, default_cache_dir, resolve_model

logger = logging.getLogger(__name__)

# Before any batch call: read by the library at each one (the module docstring says why).
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Part of the cache key: bump when the cached folder's layout or the conversion changes.
_FORMAT_VERSION = 1
_STDERR_TAIL_CHARS = 2000
# transformers' GGUF tokenizer conversion imports torch, so it runs in a child process.
_CONVERT_SCRIPT = (
    "import sys\n"
    "from transformers import AutoTokenizer\n"
    "tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2])\n"
    "tokenizer.save_pretrained(sys.argv[3])\n"
)


class ModelTokenizer:
    """Encode, decode and chat templates, matching transformers' fast tokenizer."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        # transformers turns off whatever truncation or padding tokenizer.json was saved with
        # unless a call asks for it; ours never does.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        config = _read_json(folder / "tokenizer_config.json")
        self._tokenizer.encode_special_tokens = bool(config.get("split_special_tokens", False))
        legacy_map = _read_json(folder / "special_tokens_map.json")
        self.special_tokens = _special_tokens(config, legacy_map)
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_id: int | None = self._token_id(self.special_tokens.get("eos_token"))
        self.bos_token_id: int | None = self._token_id(self.special_tokens.get("bos_token"))
        self.chat_template: str | None = _default_chat_template(folder, config)
        self._template: jinja2.Template | None = None
        self._clean_up_spaces = _cleans_up_spaces(config, self._tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def __len__(self) -> int:
        return self.vocab_size  # as transformers' len(tokenizer): added tokens counted

    def apply_chat_template(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int] | str:
        """The prompt for the assistant's next turn (its text, with `tokenize` False);
        ValueError if it cannot be rendered."""
        text = self.render_chat(messages, tools, add_generation_prompt=add_generation_prompt)
        if not tokenize:
            return text
        # The template writes the special tokens itself, so none are added around it.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def render_chat(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The chat template's text for `messages` (and the `tools` the model may call, in
        OpenAI's form), before tokenization."""
        chat, extra = template_input(self.chat_template, messages, tools)
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=chat,
                add_generation_prompt=add_generation_prompt,
                **extra,
                **self.special_tokens,
            )
        except Exception as exc:  # must not stop the stage
            raise template_error(exc) from exc

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._clean_up(self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        texts = self._tokenizer.decode_batch(seqs, skip_special_tokens=skip_special_tokens)
        return [self._clean_up(text) for text in texts]

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token decoded alone; a piece of a UTF-8 character shows as U+FFFD."""
        return self.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def vocabulary_json(self) -> str:
        """tokenizer.json as this tokenizer reads it (no truncation, no padding): what
        llguidance builds a grammar's vocabulary from."""
        return self._tokenizer.to_str()

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    def _clean_up(self, text: str) -> str:
        if not self._clean_up_spaces:
            return text
        # transformers' clean_up_tokenization, for WordPiece-style output.
        for spaced, joined in _CLEAN_UP_PAIRS:
            text = text.replace(spaced, joined)
        return text


_CLEAN_UP_PAIRS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


def load_model_tokenizer(model: str) -> ModelTokenizer | None:
    """The tokenizer for `model` (see the module docstring), or None for a random: model."""
    resolved = resolve_model(model, marker="tokenizer.json", what="a tokenizer for")
    if resolved.kind == "random":
        return None
    assert resolved.path is not None  # a file or folder for every other kind
    if resolved.kind == "gguf":
        return ModelTokenizer(gguf_tokenizer_folder(resolved.path))
    return ModelTokenizer(resolved.path)


def cached_tokenizer_folder(gguf_path: str | Path) -> Path:
    """Where the tokenizer of this exact file is cached: keyed on path, size and mtime."""
    return cached_folder(gguf_path, default_cache_dir() / "tokenizers", _FORMAT_VERSION)


def gguf_tokenizer_folder(gguf_path: str | Path) -> Path:
    """The cached tokenizer folder for `gguf_path`, converted first if not cached yet."""
    path = Path(gguf_path).resolve()
    folder = cached_tokenizer_folder(path)

    def convert(out_dir: Path) -> None:
        logger.info("converting the tokenizer of %s into %s", path, folder)
        started = time.perf_counter()
        _convert_in_child(path, out_dir)
        logger.info("converted the tokenizer in %.1fs", time.perf_counter() - started)

    return build_once(folder, convert)


def _convert_in_child(gguf_path: Path, out_dir: Path) -> None:
    # The conversion reads only the local file: offline mode keeps the hub from being asked.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    argv = [sys.executable, "-c", _CONVERT_SCRIPT, str(gguf_path.parent), gguf_path.name]
    result = subprocess.run(
        [*argv, str(out_dir)], capture_output=True, text=True, env=env, check=False
    )
    if result.returncode != 0 or not (out_dir / "tokenizer.json").is_file():
        tail = result.stderr[-_STDERR_TAIL_CHARS:].strip() or "(no stderr)"
        raise RuntimeError(
            f"converting the tokenizer of {gguf_path} failed (exit {result.returncode}; "
            f"it needs transformers installed): {tail}"
        )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _special_tokens(config: dict[str, Any], legacy_map: dict[str, Any]) -> dict[str, str]:
    """`bos_token`, `eos_token` and any model-specific `*_token`, as the template sees them.

    A token is saved either as its text or as a serialized AddedToken ({"content": ...}).
    """
    tokens = {}
    for source in (legacy_map, config):  # tokenizer_config.json wins over the legacy file
        for key, value in source.items():
            if isinstance(value, dict) and isinstance(value.get("content"), str):
                value = value["content"]
            if key.endswith("_token") and isinstance(value, str):
                tokens[key] = value
    return tokens


def _cleans_up_spaces(config: dict[str, Any], tokenizer: tokenizers.Tokenizer) -> bool:
    if not config.get("clean_up_tokenization_spaces", False):
        return False
    # transformers 5 skips the clean-up for BPE models, where it deletes real spaces, unless
    # the config insists.
    is_bpe = type(tokenizer.model).__name__ == "BPE"
    insists = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"
    return not is_bpe or bool(config.get(insists, False))


def _default_chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    # Same priority as transformers: template files over the entry in tokenizer_config.json.
    for name in ("chat_template.jinja", "additional_chat_templates/default.jinja"):
        file = folder / name
        if file.is_file():
            return file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _compile_template(source: str) -> jinja2.Template:
    # Chat templates come with the model, so they are untrusted code: sandboxed, as in
    # transformers, with the helpers Hub templates rely on.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the model's chat template does not parse: {exc}") from exc


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's own filter, no HTML escaping: the output is a prompt, not a web page.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore names (a route to Python internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]  # jinja's trick: `namespace(self=...)` must still work
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    some templates; here it only has to parse, and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)
