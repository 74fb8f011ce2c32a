"""What an ingress replica measures: HTTP requests and the latencies its clients see.

Token totals, queue time and KV use are the workers' (gpu_worker/worker_metrics.py), the
stages' loops their own (observability/); `/metrics` serves them all, read from Redis
(observability/deployment_metrics.py).
"""

from __future__ import annotations

from observability.metrics import ProcessMetrics

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class IngressMetrics:
    def __init__(self, frontend_id: str, enabled: bool = True) -> None:
        self.process = m = ProcessMetrics("ingress", frontend_id, enabled)
        self.requests = m.counter(
            "requests",
            "HTTP requests by route and status code (499: the client went away).",
            ["endpoint", "status"],
        )
        self.in_flight = m.gauge("requests_in_flight", "HTTP requests being handled.")
        self.ttft = m.histogram(
            "time_to_first_token_seconds", "From request arrival to its first token.",
            TTFT_BUCKETS_S,
        )  # fmt: skip
        self.itl = m.histogram(
            "inter_token_latency_seconds", "Between two tokens of one request.", ITL_BUCKETS_S
        )
        self.e2e = m.histogram(
            "e2e_request_latency_seconds", "From request arrival to its last token.",
            E2E_BUCKETS_S,
        )  # fmt: skip
        self.resumes = m.counter(
            "stream_resumes", "Streams resumed here with Last-Event-ID (another replica's)."
        )
        self.aborts = m.counter(
            "request_aborts", "Requests aborted: the client went away or asked (/v1/abort)."
        )

    def token_times(self, first: bool, seconds: float, tokens: int) -> None:
        """A delta of `tokens` tokens, `seconds` after the request's arrival (`first`) or
        after its previous tokens; a delta of several (a publish of several steps, a
        speculation) spreads the gap over them, and the first delta's tokens past its first
        came with it (0 s). So a request's tokens but its first are each observed once, and
        their sum is the time from its first token to its last."""
        if first:
            self.ttft.observe(seconds)
            self.itl.observe_later(0.0, tokens - 1)
            return
        self.itl.observe_later(seconds / tokens, tokens)

    def request_ended(self, seconds: float) -> None:
        """A request's last token, `seconds` after its arrival: its end-to-end latency, and
        every inter-token latency held so far (`token_times` holds them: a request's are all
        in the histogram once it ended)."""
        self.e2e.observe(seconds)
        self.itl.flush()
