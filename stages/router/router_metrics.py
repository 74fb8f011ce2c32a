"""What the router measures of its routing decisions (stages/router/kv_routing.py).

The tokens it expected each worker to find cached sit beside what the workers found
(``prefix_cache_hits``, counted per worker from each Finish, gpu_worker/worker_metrics.py):
with the same worker label, their rates compare directly in the dashboard's routing panel.
"""

from __future__ import annotations

from observability.metrics import ProcessMetrics
from stages.router.kv_routing import Choice


class RouterMetrics:
    def __init__(self, process: ProcessMetrics) -> None:
        self.decisions = process.counter(
            "router_decisions", "Jobs routed, by why their worker was chosen.", ["reason"]
        )
        self.expected_cached = process.counter(
            "router_expected_cached_tokens",
            "Prompt tokens the router expected the chosen worker to find in its prefix cache.",
            ["worker"],
        )  # fmt: skip
        self.routed_prompt_tokens = process.counter(
            "router_routed_prompt_tokens", "Prompt tokens routed, by worker.", ["worker"]
        )

    def decided(self, choice: Choice, prompt_tokens: int) -> None:
        worker = choice.worker.worker_id
        self.decisions.labels(choice.reason).inc()
        self.expected_cached.labels(worker).inc(choice.expected_cached)
        self.routed_prompt_tokens.labels(worker).inc(prompt_tokens)
