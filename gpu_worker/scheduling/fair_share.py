"""Weighted fair queueing between tenants (API keys), within a priority class.

Start-time fair queueing: each request gets a start tag when it arrives, the later of the
virtual time (the tag of the last request admitted) and its tenant's previous request's
finish tag; its finish tag adds its cost (prompt plus asked-for tokens) over its tenant's
weight. Waiting requests are admitted in tag order, so a tenant that floods the queue lines
its requests up one behind another, while another tenant's request arriving meanwhile
starts at the virtual time: right after what is being admitted now, not behind the flood.
With one tenant the tags follow arrival order, and nothing changes.
"""

from __future__ import annotations

from gpu_worker.scheduling.req import Req

# Every this many tags, the tenants whose finish tag is not past the virtual time (they
# start afresh anyway) are forgotten, so the table holds only recent tenants.
PRUNE_EVERY = 1024


class FairShare:
    def __init__(self) -> None:
        self.virtual_time = 0.0
        self.finish: dict[str, float] = {}
        self._tagged = 0

    def tag(self, req: Req) -> None:
        """Give an arriving request its start tag."""
        start = max(self.virtual_time, self.finish.get(req.tenant, 0.0))
        cost = len(req.origin_input_ids) + req.params.max_new_tokens
        self.finish[req.tenant] = start + cost / req.weight
        req.fair_tag = start
        self._tagged += 1
        if self._tagged % PRUNE_EVERY == 0:
            self.finish = {t: f for t, f in self.finish.items() if f > self.virtual_time}

    def admitted(self, req: Req) -> None:
        self.virtual_time = max(self.virtual_time, req.fair_tag)
