"""The CPU kernels as another revision had them, built beside this tree's, so a benchmark can
time both in one process (bench_extend_attention.py, bench_gemm.py --base)."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

from gpu_worker.kernels import cpu_kernels, kernel_build

ROOT = Path(__file__).resolve().parent.parent


def build(folder: Path, target: Path) -> cpu_kernels.CpuKernels:
    """The library from the kernel sources in `folder`, as cpu_kernels builds it."""
    kernel_build.compile_library(kernel_build.find_compiler() or "gcc", target, folder)
    return cpu_kernels.CpuKernels(ctypes.CDLL(str(target)))


def checkout_kernels(revision: str, folder: Path) -> None:
    """The kernel files as they were at `revision` (those it has) into `folder`."""
    for path in kernel_build.SOURCES + kernel_build.HEADERS:
        spec = f"{revision}:{path.relative_to(ROOT)}"
        shown = subprocess.run(["git", "-C", str(ROOT), "show", spec], capture_output=True)
        if shown.returncode == 0:
            (folder / path.name).write_bytes(shown.stdout)


def kernels_at(revision: str, scratch: Path) -> cpu_kernels.CpuKernels:
    """`revision`'s kernels, built in `scratch` (loaded: the folder may go afterwards)."""
    checkout_kernels(revision, scratch)
    return build(scratch, scratch / f"kernels-{revision.replace('/', '_')}.so")
