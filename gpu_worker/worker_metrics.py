"""What a worker measures, in vLLM's names where vLLM measures the same thing.

Generated tokens count as each step publishes them (a live tokens-per-second figure);
request counts and prompt tokens when a request finishes, from the figures its Finish
carries to the user, so across the deployment they equal what the users were told (a job
that moved off a dead worker counts once, on the worker that finished it). Queue time
runs from the job's creation (the ingress, or bus.client) to the start of the step that
computed its first token.
"""

from __future__ import annotations

from gpu_worker.model_executor.forward_mode import ForwardMode
from jobs.protocol import Finish
from observability.metrics import ProcessMetrics

QUEUE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)
STEP_KINDS = {ForwardMode.EXTEND: "prefill", ForwardMode.DECODE: "decode",
              ForwardMode.TARGET_VERIFY: "verify"}  # fmt: skip


class WorkerMetrics:
    def __init__(self, process: ProcessMetrics, total_kv_tokens: int) -> None:
        self.process = process
        self.total_kv_tokens = total_kv_tokens
        m = process
        self.running = m.gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = m.gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = m.gauge("kv_cache_usage_perc", "Fraction of KV cache slots in use (0-1).")
        self.prefix_queries = m.counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = m.counter("prefix_cache_hits", "Prompt tokens found in it.")
        self.prompt_tokens = m.counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = m.counter("generation_tokens", "Tokens generated.")
        self.success = m.counter(
            "request_success", "Requests finished, by reason.", ["finished_reason"]
        )
        self.queue_time = m.histogram(
            "request_queue_time_seconds",
            "From the job's creation to the start of the step computing its first token.",
            QUEUE_BUCKETS_S,
        )
        self.preemptions = m.counter(
            "num_preemptions", "Requests retracted to free KV (they run again later)."
        )
        self.drafts = m.counter("spec_decode_num_draft_tokens", "Speculative tokens drafted.")
        self.accepted = m.counter("spec_decode_num_accepted_tokens", "Drafted tokens accepted.")
        self.step_seconds = m.histogram(
            "worker_step_seconds", "One engine step: forward and sampling.", STEP_BUCKETS_S,
            ["kind"],
        )  # fmt: skip
        self.migrated_in = m.counter(
            "worker_jobs_migrated_in", "Jobs begun elsewhere and continued here."
        )
        self.step_failures = m.counter(
            "worker_step_failures", "Steps that raised; their jobs were admitted again."
        )
        self.info = m.gauge(
            "worker_info", "What serves this worker (value 1).",
            ["model", "attention", "graphs", "cpu_kernels"],
        )  # fmt: skip
        self._retractions = 0

    def describe(self, model: str, attention: str, graphs: bool, cpu_kernels: bool) -> None:
        self.info.labels(model, attention, _on(graphs), _on(cpu_kernels)).set(1)

    def load(self, running: int, waiting: int, free_kv_tokens: int, retractions: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(1 - free_kv_tokens / self.total_kv_tokens)
        if retractions > self._retractions:
            self.preemptions.inc(retractions - self._retractions)
            self._retractions = retractions

    def step(self, mode: ForwardMode | None, seconds: float) -> None:
        if mode is not None:
            self.step_seconds.labels(STEP_KINDS.get(mode, mode.name.lower())).observe(seconds)

    def finished(self, finish: Finish) -> None:
        self.success.labels(finish.reason).inc()
        self.prompt_tokens.inc(finish.prompt_tokens)
        self.prefix_queries.inc(finish.prompt_tokens)
        self.prefix_hits.inc(finish.cached_tokens)
        if finish.draft_tokens:
            self.drafts.inc(finish.draft_tokens)
            self.accepted.inc(finish.accepted_draft_tokens)


def _on(flag: bool) -> str:
    return "on" if flag else "off"
