#!/usr/bin/env bash
# Install llama.cpp's OpenAI-compatible server (PyPI `llama-cpp-python[server]`, built from
# source: PyPI has no binary wheel) into its own virtualenv, for bench_peers.py.
#
#   bash benchmarks/peers/install_llama_cpp.sh [VENV_DIR]   (default: ~/.cache/streamserve/peers/llama-cpp)
#
# The build compiles llama.cpp with CMake (about 10 minutes on 2 cores); -march=native
# makes it use this CPU's vector units, as a user building it here would get.
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
VENV=${1:-${STREAMSERVE_CACHE:-$HOME/.cache/streamserve}/peers/llama-cpp}
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
CMAKE_ARGS="-DGGML_NATIVE=ON" "$VENV/bin/python" -m pip install -q "llama-cpp-python[server]==$VERSION"
echo "llama-cpp-python $VERSION installed in $VENV"
