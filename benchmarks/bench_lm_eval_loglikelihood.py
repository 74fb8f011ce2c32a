"""lm-evaluation-harness's own API model against a running streamserve: loglikelihood requests.

lm-eval's ``local-completions`` model scores a (context, continuation) pair by sending the
tokens of both to /v1/completions with ``echo: true, logprobs: 1, max_tokens: 1`` and summing
the continuation's prompt logprobs. This drives that class (not a copy of it) through a
handful of pairs and prints one JSON line per pair: lm-eval's loglikelihood and is_greedy,
and with ``--reference`` transformers' own for the same tokens (float32) and the difference.

lm-eval's install is heavy (datasets, evaluate, ...), so this is a script, not a test. In a
virtualenv of its own::

    python -m venv /tmp/lmeval
    /tmp/lmeval/bin/pip install torch==2.13.0 lm-eval transformers accelerate gguf
    streamserve up --port 8300 --worker-arg=--dtype=float32 &
    /tmp/lmeval/bin/python benchmarks/bench_lm_eval_loglikelihood.py --url http://127.0.0.1:8300 \\
        --tokenizer ~/.cache/streamserve/tokenizers/<the model's folder> --reference GGUF_FILE

``--tokenizer`` is a Hugging Face tokenizer folder for the served model (streamserve caches
the default model's, converted from its GGUF, under ~/.cache/streamserve/tokenizers/).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

PAIRS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " London"),
    ("Two plus two equals", " four"),
    ("Water freezes at zero degrees", " Celsius"),
    ("The opposite of hot is", " cold"),
    ("Question: Is the sky blue? Answer:", " yes"),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--url", required=True, help="the streamserve ingress, e.g. http://127.0.0.1:8300"
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the served model's name")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    parser.add_argument("--reference", help="a GGUF file: compare with transformers' logprobs")
    return parser


def _reference(gguf: str, tokenizer, pairs) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=torch.float32).eval()  # fmt: skip
    sums = []
    for context, continuation in pairs:
        # As lm-eval splits them: the continuation's tokens are those after the context's.
        whole = tokenizer.encode(context + continuation)
        start = len(tokenizer.encode(context))
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
        sums.append(sum(logprobs[p - 1, whole[p]].item() for p in range(start, len(whole))))
    return sums


def main() -> None:
    args = _parser().parse_args()
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=args.url.rstrip("/") + "/v1/completions", model=args.model,
        tokenizer_backend="huggingface", tokenizer=args.tokenizer, tokenized_requests=True,
        num_concurrent=1, max_retries=1,
    )  # fmt: skip
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i)
        for i, pair in enumerate(PAIRS)
    ]
    started = time.perf_counter()
    results = lm.loglikelihood(requests)
    seconds = time.perf_counter() - started
    expected = _reference(args.reference, lm.tokenizer, PAIRS) if args.reference else None
    for i, ((context, continuation), (logprob, greedy)) in enumerate(
        zip(PAIRS, results, strict=True)
    ):
        line = {"context": context, "continuation": continuation, "loglikelihood": logprob,
                "is_greedy": greedy}  # fmt: skip
        if expected is not None:
            line.update(transformers=expected[i], abs_diff=abs(logprob - expected[i]))
        print(json.dumps(line))
    summary = {"requests": len(PAIRS), "seconds": round(seconds, 3),
               "all_finite": all(math.isfinite(lp) for lp, _ in results)}  # fmt: skip
    if expected is not None:
        summary["max_abs_diff"] = max(
            abs(lp - e) for (lp, _), e in zip(results, expected, strict=True)
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
