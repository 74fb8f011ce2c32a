"""How the CPU kernels' library is built (gpu_worker/kernels/cpu_kernels.py loads it): the C
sources beside this file, compiled once per machine with the system C compiler and
-march=native, so it uses whatever vector units this CPU has, into the streamserve cache
folder, keyed by the sources, the compiler command and the CPU's flags.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from runtime.model_files import default_cache_dir

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [
    _HERE / name
    for name in (
        "activation.c",
        "attention.c",
        "decoder_layers.c",
        "extend_attention.c",
        "gemm_bf16.c",
        "gemm_f32.c",
        "layers.c",
        "sampling.c",
    )
]
HEADERS = sorted(_HERE.glob("*.h"))  # every one is part of the build (its cache key)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]


def find_compiler() -> str | None:
    """The C compiler the kernels are built with: CC, else cc, else gcc (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_library(
    compiler: str, target: Path, folder: Path | None = None, defines: Sequence[str] = ()
) -> None:
    """Builds the kernel sources in `folder` (default: beside this file) into `target`, with
    `defines` as -D flags (STREAMSERVE_EMULATE_AMX: the tests' build of the AMX path)."""
    # A revision's folder holds the sources it had (bench_extend_attention builds older ones).
    sources = [str(f) for path in SOURCES if (f := (folder or _HERE) / path.name).exists()]
    flags = [f"-D{define}" for define in defines]
    command = [compiler, *CFLAGS, *flags, *sources, "-o", str(target), "-lm"]
    subprocess.run(command, check=True, capture_output=True, text=True)


def build_library(compiler: str) -> Path:
    """The library built from this folder's sources with `compiler`, cached per source,
    command and CPU."""
    source = b"".join(path.read_bytes() for path in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join([compiler, *CFLAGS]).encode() + _cpu_flags())
    target = default_cache_dir() / "kernels" / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("building the CPU kernels with %s (once per machine)", compiler)
    # Build beside the target and rename: concurrent workers never load a half-written file.
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        compile_library(compiler, partial)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _cpu_flags() -> bytes:
    """The CPU's feature flags: a library built with -march=native runs only where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.encode()
    except OSError:
        pass
    return b""
