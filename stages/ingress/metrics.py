"""Prometheus metrics of one ingress replica, in the text exposition format (version 0.0.4).

Written by hand: a few counters and two histograms do not need a client library.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Sequence

PREFIX = "streamserve_ingress"
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = list(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip([*self.bounds, float("inf")], self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {cumulative}')
        out += [f"{name}_sum {self.sum!r}", f"{name}_count {self.count}"]
        return out


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    def __init__(self) -> None:
        self.requests: collections.Counter[tuple[str, str]] = collections.Counter()
        self.in_flight = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)
        self.live_workers = 0

    def count_request(self, endpoint: str, status: int | str) -> None:
        self.requests[(endpoint, str(status))] += 1

    def render(self) -> str:
        lines = [
            f"# HELP {PREFIX}_requests_total HTTP requests by endpoint and status code "
            "(499: the client went away).",
            f"# TYPE {PREFIX}_requests_total counter",
        ]
        for (endpoint, status), count in sorted(self.requests.items()):
            lines.append(
                f'{PREFIX}_requests_total{{endpoint="{_label(endpoint)}",'
                f'status="{status}"}} {count}'
            )
        for name, kind, value, help_text in (
            ("requests_in_flight", "gauge", self.in_flight, "HTTP requests being handled."),
            ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens processed."),
            ("generation_tokens_total", "counter", self.generated_tokens, "Tokens generated."),
            (
                "draft_tokens_total",
                "counter",
                self.draft_tokens,
                "Speculative draft tokens verified, of finished requests.",
            ),
            (
                "accepted_draft_tokens_total",
                "counter",
                self.accepted_draft_tokens,
                "Speculative draft tokens accepted (their ratio to draft_tokens_total is the "
                "acceptance rate).",
            ),
            ("live_workers", "gauge", self.live_workers, "Workers with a live heartbeat."),
        ):
            lines += [
                f"# HELP {PREFIX}_{name} {help_text}",
                f"# TYPE {PREFIX}_{name} {kind}",
                f"{PREFIX}_{name} {value}",
            ]
        for name, histogram, help_text in (
            ("time_to_first_token_seconds", self.ttft, "From request arrival to first token."),
            ("inter_token_latency_seconds", self.itl, "Between two tokens of one request."),
        ):
            lines += [f"# HELP {PREFIX}_{name} {help_text}", f"# TYPE {PREFIX}_{name} histogram"]
            lines += histogram.lines(f"{PREFIX}_{name}")
        return "\n".join(lines) + "\n"
