"""`python -m gpu_worker.chat "question"`: stream one chat answer from the in-process engine."""

from __future__ import annotations

import argparse
import sys

from gpu_worker.config import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpu_worker.chat", description=__doc__)
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--raw", action="store_true", help="send the prompt without chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)

    from gpu_worker import Engine

    try:
        engine = Engine(args.model, dtype=args.dtype, device=args.device)
        params = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
        if args.raw:
            stream = engine.generate_stream(args.prompt, params)
        else:
            stream = engine.generate_stream(
                messages=[{"role": "user", "content": args.prompt}], sampling_params=params
            )
        for chunk in stream:
            sys.stdout.write(chunk["text"] or "")
            sys.stdout.flush()
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
