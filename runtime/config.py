"""Every user-tunable bus setting, in one place, with its default.

Environment variables read by ``BusConfig.from_env``:

- ``REDIS_URL``: the server to use (``redis://``, ``rediss://`` or ``unix://``). Unset or
  empty: start the embedded server.
- ``STREAMSERVE_STREAM_PREFIX``: prefix of every stream and key name (default ``streamserve``).
- ``STREAMSERVE_SHARD``: the Redis Cluster shard this process works on (runtime/cluster.py
  finds one by itself; set it to pin a process). Every stream and key name then carries it
  as a hash tag, ``<prefix>:{<shard>}:...``, so all of one shard's names hash to one slot
  and live on one primary. Unset: no tag (a plain server).
- ``STREAMSERVE_STREAM_MAXLEN``: approximate ``MAXLEN`` of the dead-letter stream (it is for
  people). The streams that carry work are never cut by a count: they are trimmed only below
  what every consumer group has acknowledged (bus/stream_trim.py).
- ``STREAMSERVE_TRIM_INTERVAL_S``: seconds between two trims of a stream by one of its consumers.
- ``STREAMSERVE_REDIS_MAXMEMORY``: ``maxmemory`` of the embedded server (valkey's units:
  ``512mb``, ``1gb``); it runs with ``noeviction``, so a full Redis refuses writes (the
  ingress answers 503 with Retry-After) rather than dropping keys a job needs.
- ``STREAMSERVE_READ_COUNT``, ``STREAMSERVE_BLOCK_MS``: most entries one ``XREADGROUP``
  returns, and how long it blocks for them: a new entry ends the wait at once, as a stop
  (SIGTERM, SIGINT) does, so this bounds only how often an idle stage polls Redis.
- ``STREAMSERVE_CLAIM_IDLE_MS``: how long an entry stays pending before another consumer
  takes it over with ``XAUTOCLAIM``.
- ``STREAMSERVE_MAX_DELIVERIES``: deliveries after which an entry (or a job whose workers
  died holding it, counted across the reaper's requeues) is dead-lettered with an error reply.
- ``STREAMSERVE_HEARTBEAT_INTERVAL_S``: seconds between a worker's heartbeats.
- ``STREAMSERVE_HEARTBEAT_TTL_S``: seconds a heartbeat key lives; a worker silent longer is dead.
- ``STREAMSERVE_WORKER_STALL_S``: seconds a worker's engine loop may go without turning
  (one step, or a wait for Redis) before the worker takes itself for hung and exits.
- ``STREAMSERVE_REPLY_TTL_S``: seconds a reply stream lives after its expiry's last renewal
  (at least 3/4 of it after its last write); a dead reader leaves nothing for longer.
- ``STREAMSERVE_REPLY_TIMEOUT_S``: seconds an HTTP request may wait with no reply to any of
  its sub-requests before the ingress answers 504 and aborts it.
- ``STREAMSERVE_NO_WORKER_TIMEOUT_S``: how long the router holds a job while no worker is
  alive before failing it with an error reply.
- ``STREAMSERVE_METRICS``: ``0`` turns every process's metrics off (observability/metrics.py).
- ``STREAMSERVE_METRICS_INTERVAL_S``: seconds between two publications of a process's
  metrics to Redis, where any ingress's ``/metrics`` and ``streamserve status`` read them.
- ``STREAMSERVE_BATCH_CONCURRENCY``: lines of one batch an ingress replica runs at once.
- ``STREAMSERVE_BATCH_LEASE_S``: seconds a batch's runner holds it without renewing; a
  runner silent for longer (its ingress died) leaves the batch to another replica.
- ``STREAMSERVE_MAX_FILE_BYTES``, ``STREAMSERVE_MAX_BATCH_LINES``: the largest upload to
  ``/v1/files`` and the most lines a batch takes.
- ``STREAMSERVE_MAX_BATCH_LINE_BYTES``: the largest batch input line that runs (the
  ingress's own body limit); a longer one is a line error in the batch's error file.
- ``STREAMSERVE_MAX_FILES_PER_OWNER``, ``STREAMSERVE_MAX_BYTES_PER_OWNER``: the files, and
  their bytes, one owner (an API key's tenant, docs/BOUNDS.md) may keep (an upload past
  either is a 4xx; a batch's own files count, never refused); ``..._MAX_ACTIVE_BATCHES_...``
  its batches not yet ended (a 429 past it); ``STREAMSERVE_MAX_RESPONSES_PER_OWNER`` and
  ``..._MAX_RESPONSE_BYTES_...``, its stored responses (past either, its oldest go).
- ``STREAMSERVE_FILE_EXPIRY_S``: seconds a file lives when its upload gives no
  ``expires_after``, and a batch's output and error files (OpenAI's 30 days);
  ``STREAMSERVE_RESPONSE_TTL_S``: a stored ``/v1/responses`` answer (also 30 days).
- ``STREAMSERVE_BATCH_RESULT_TTL_S``: seconds a batch's per-line result hashes outlive its
  end (its output and error files hold the results from then on).
- ``STREAMSERVE_INGRESS_HEADER_TIMEOUT_S``: seconds an ingress connection may take to send a
  request's headers, from its opening or the end of its previous response (also how long
  an idle keep-alive connection stays open); past it the connection is closed.
- ``STREAMSERVE_INGRESS_BODY_TIMEOUT_S``: seconds a request body may take to arrive once
  its headers have, plus one per 256 KiB of its Content-Length; past it the request gets a
  408 and its connection is closed.
- ``STREAMSERVE_INGRESS_MAX_CONNECTIONS``: open connections one ingress replica serves at
  once; one more gets a 503 with Retry-After and is closed.

KV-aware routing (stages/router/kv_routing.py): ``STREAMSERVE_ROUTER_POLICY`` (``kv``, or
``load`` alone), ``STREAMSERVE_KV_BLOCK_TOKENS`` (per hashed block, a multiple of the page
size), ``STREAMSERVE_KV_CACHE_WEIGHT``, ``STREAMSERVE_KV_LOAD_WEIGHT``,
``STREAMSERVE_KV_JOB_LOAD_TOKENS`` (a queued job's weight in tokens),
``STREAMSERVE_KV_BALANCE_JOBS`` (how far a hot prefix's holder may lead the least loaded),
``STREAMSERVE_KV_EVENTS_MAXLEN``, ``STREAMSERVE_KV_SNAPSHOT_INTERVAL_S`` (the events stream).

Request bounds (docs/BOUNDS.md), each a 400 naming the field it is about:

- ``STREAMSERVE_MAX_STOP_STRINGS``, ``STREAMSERVE_MAX_STOP_CHARS``,
  ``STREAMSERVE_MAX_STOP_TOTAL_CHARS``: the most stop strings a request gives, the longest
  one and all of them together, in characters.
- ``STREAMSERVE_MAX_STOP_TOKEN_IDS``: the most ``stop_token_ids``.
- ``STREAMSERVE_MAX_LOGIT_BIAS``: the most ``logit_bias`` entries.
- ``STREAMSERVE_MAX_GRAMMAR_BYTES``, ``STREAMSERVE_MAX_GRAMMAR_DEPTH``: the largest
  structured-output grammar (``json_schema``, ``regex``, ``ebnf``, ``response_format``, a
  tool grammar) in UTF-8 bytes, and its deepest nesting of brackets.
- ``STREAMSERVE_GRAMMAR_COMPILE_TIMEOUT_S``: how long compiling one grammar may take, at
  the ingress and in the worker, before the request is refused.
- ``STREAMSERVE_MAX_CHOICES``: the most choices (prompts x ``n``) of one HTTP request.
- ``STREAMSERVE_MAX_REQUEST_PROMPT_TOKENS``: ``n`` x the prompts' size of one HTTP request
  (token ids count one each, a text prompt its UTF-8 bytes: at least its tokens).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from runtime.key_ids import require_id as _require_id

ENV_PREFIX = "STREAMSERVE_"
REDIS_URL_ENV = "REDIS_URL"
_URL_SCHEMES = ("redis://", "rediss://", "unix://")
# valkey's memory units; 0 (no limit) is refused: an unbounded Redis is what this guards.
_MEMORY = re.compile(r"[1-9][0-9]*(b|k|kb|m|mb|g|gb)?", re.IGNORECASE)
ROUTER_POLICIES = ("kv", "load")
_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}  # fmt: skip


@dataclass(frozen=True)
class BusConfig:
    redis_url: str | None = None  # None: start the embedded server
    stream_prefix: str = "streamserve"
    shard: str | None = None  # a Redis Cluster shard's tag (runtime/cluster.py); None: none
    stream_maxlen: int = 100_000
    read_count: int = 64
    block_ms: int = 1_000
    claim_idle_ms: int = 5_000
    max_deliveries: int = 3
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 5.0
    worker_stall_s: float = 300.0
    reply_ttl_s: int = 3_600
    no_worker_timeout_s: float = 30.0
    metrics: bool = True
    metrics_interval_s: float = 2.0
    batch_concurrency: int = 32
    batch_lease_s: float = 10.0
    max_file_bytes: int = 200 * 2**20  # OpenAI's limit for a batch input file
    max_batch_lines: int = 50_000  # OpenAI's
    max_batch_line_bytes: int = 8 * 2**20  # the ingress's body limit: a line is one request
    # Redis holds files in memory: 1 GiB is five of the largest uploads, and the 10,000 files
    # one list page (MAX_LIST_LIMIT) can show.
    max_files_per_owner: int = 10_000
    max_bytes_per_owner: int = 2**30
    max_active_batches_per_owner: int = 100  # not yet ended: what runners pick among
    file_expiry_s: int = 30 * 24 * 3600  # OpenAI's default for batch files
    batch_result_ttl_s: int = 3_600  # the files hold the results; the hashes, for inspection
    response_ttl_s: int = 30 * 24 * 3600  # a stored response (stages/ingress/responses/)
    max_responses_per_owner: int = 100_000  # past either, the oldest go (responses/quota.py)
    max_response_bytes_per_owner: int = 2**30
    # Above the idle time common HTTP clients keep a pooled connection (httpx 5 s, aiohttp
    # 15 s), so the server is not the one to close a connection a client is reusing.
    ingress_header_timeout_s: float = 20.0
    ingress_body_timeout_s: float = 60.0  # plus a second per 256 KiB of the body
    ingress_max_connections: int = 512  # each an fd; below the usual 1024 of `ulimit -n`
    trim_interval_s: float = 5.0
    # A busy worker publishes its tokens at most this often (0: every engine step): each
    # publish costs the bus about a dozen commands, whatever it carries.
    publish_interval_ms: int = 50
    # A busy worker reads the aborts stream (bus/aborts.py) at most this often, in its
    # commit: one XREAD for all its jobs. An abort ends a running job within about this.
    abort_check_interval_ms: int = 500
    redis_maxmemory: str = "1gb"
    reply_timeout_s: float = 3_600.0  # as long as a reply stream outlives its last write
    # Request bounds: see docs/BOUNDS.md and jobs/request_bounds.py.
    max_stop_strings: int = 16  # OpenAI allows 4; vLLM does not bound them
    max_stop_chars: int = 256
    max_stop_total_chars: int = 1024
    max_stop_token_ids: int = 256
    max_logit_bias: int = 300  # OpenAI's
    max_grammar_bytes: int = 256 * 2**10
    max_grammar_depth: int = 64
    grammar_compile_timeout_s: float = 10.0
    max_choices: int = 128
    max_request_prompt_tokens: int = 2**20
    router_policy: str = "kv"  # or "load"
    kv_block_tokens: int = 32
    kv_cache_weight: float = 1.0
    kv_load_weight: float = 1.0
    kv_job_load_tokens: int = 64  # a few turns' history outweighs a job or two queued
    kv_balance_jobs: int = 4
    kv_events_maxlen: int = 10_000
    kv_snapshot_interval_s: float = 30.0

    def __post_init__(self) -> None:
        if self.redis_url is not None and not self.redis_url.startswith(_URL_SCHEMES):
            raise ValueError(
                f"redis_url must start with one of {', '.join(_URL_SCHEMES)}; "
                f"got {self.redis_url!r}"
            )
        if not self.stream_prefix or any(c.isspace() for c in self.stream_prefix):
            raise ValueError(
                f"stream_prefix must be non-empty without whitespace; got {self.stream_prefix!r}"
            )
        if self.shard is not None:
            _require_id("shard", self.shard, forbidden=":{}")
            if "{" in self.stream_prefix:  # Redis would hash the prefix's braces instead
                raise ValueError(
                    f"stream_prefix must not hold '{{' with a shard; got {self.stream_prefix!r}"
                )
        for name in (
            "stream_maxlen",
            "read_count",
            "claim_idle_ms",
            "max_deliveries",
            "reply_ttl_s",
            "batch_concurrency",
            "max_file_bytes",
            "max_batch_lines",
            "max_batch_line_bytes",
            "max_files_per_owner",
            "max_bytes_per_owner",
            "max_active_batches_per_owner",
            "file_expiry_s",
            "batch_result_ttl_s",
            "response_ttl_s",
            "max_responses_per_owner",
            "max_response_bytes_per_owner",
            "ingress_max_connections",
            "max_stop_strings",
            "max_stop_chars",
            "max_stop_total_chars",
            "max_stop_token_ids",
            "max_logit_bias",
            "max_grammar_bytes",
            "max_grammar_depth",
            "max_choices",
            "max_request_prompt_tokens",
            "kv_block_tokens",
            "kv_events_maxlen",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        # 0 would mean "block forever" to XREADGROUP, and a stage must stay responsive.
        _require_int("block_ms", self.block_ms, minimum=1)
        _require_int("publish_interval_ms", self.publish_interval_ms, minimum=0)
        _require_int("abort_check_interval_ms", self.abort_check_interval_ms, minimum=0)
        _require_int("kv_job_load_tokens", self.kv_job_load_tokens, minimum=0)
        _require_int("kv_balance_jobs", self.kv_balance_jobs, minimum=0)
        if self.router_policy not in ROUTER_POLICIES:
            raise ValueError(f"router_policy must be kv or load; got {self.router_policy!r}")
        for name in ("kv_cache_weight", "kv_load_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{name} must be a number >= 0; got {value!r}")
        for name in (
            "heartbeat_interval_s",
            "heartbeat_ttl_s",
            "worker_stall_s",
            "no_worker_timeout_s",
            "metrics_interval_s",
            "batch_lease_s",
            "ingress_header_timeout_s",
            "ingress_body_timeout_s",
            "trim_interval_s",
            "reply_timeout_s",
            "grammar_compile_timeout_s",
            "kv_snapshot_interval_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number; got {value!r}")
        if not isinstance(self.redis_maxmemory, str) or not _MEMORY.fullmatch(self.redis_maxmemory):
            raise ValueError(
                f"redis_maxmemory must be a positive size such as 512mb or 1gb; "
                f"got {self.redis_maxmemory!r}"
            )
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            # Otherwise a live worker's key expires between two beats.
            raise ValueError(
                f"heartbeat_ttl_s ({self.heartbeat_ttl_s}) must exceed "
                f"heartbeat_interval_s ({self.heartbeat_interval_s})"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides: Any) -> BusConfig:
        """Defaults, then the environment, then ``overrides`` (keyword per field)."""
        fields = dataclasses.fields(cls)
        unknown = set(overrides) - {f.name for f in fields}
        if unknown:
            raise TypeError(f"unknown BusConfig fields: {', '.join(sorted(unknown))}")
        values: dict[str, Any] = {}
        variables: dict[str, str] = {}  # field -> the variable that set it
        for field in fields:
            variable = env_variable(field.name)
            raw = environ.get(variable, "").strip()
            if not raw or field.name in overrides:
                continue
            values[field.name] = _parse(variable, raw, field.type)
            variables[field.name] = variable
        values.update(overrides)
        try:
            return cls(**values)
        except ValueError as exc:
            # Validation speaks in field names; a user fixing it needs the variable's name.
            named = [v for f, v in variables.items() if re.search(rf"\b{f}\b", str(exc))]
            if not named:
                raise
            raise ValueError(f"{', '.join(named)}: {exc}") from None

    @property
    def uses_embedded_server(self) -> bool:
        return self.redis_url is None

    @property
    def key_prefix(self) -> str:
        """What every name starts with: ``<stream_prefix>``, or ``<stream_prefix>:{<shard>}``
        on a cluster shard (the braces make Redis hash only the shard, so every name of one
        shard is in one slot, and a MULTI over any of them is allowed)."""
        if self.shard is None:
            return self.stream_prefix
        return f"{self.stream_prefix}:{{{self.shard}}}"

    def key_name(self, *parts: str) -> str:
        """``<key_prefix>:<part>:...``: every stream and key of one deployment is named so
        (an id in a name is checked by `_require_id` first: a ':' in it would be ambiguous).
        Code outside this class that needs a name of its own builds it here."""
        return ":".join((self.key_prefix, *parts))

    _name = key_name

    def requests_stream(self) -> str:
        return self._name("requests")

    def tokenized_stream(self) -> str:
        return self._name("tokenized")

    def tokens_stream(self) -> str:
        return self._name("tokens")

    def worker_stream(self, worker_id: str) -> str:
        return self._name("worker", _require_id("worker_id", worker_id))

    def reply_stream(self, frontend_id: str) -> str:
        return self._name("reply", _require_id("frontend_id", frontend_id))

    def dead_letter_stream(self) -> str:
        return self._name("dead-letter")

    def heartbeat_key(self, worker_id: str) -> str:
        return self._name("heartbeat", _require_id("worker_id", worker_id))

    def workers_key(self) -> str:
        """A set of the worker ids that beat; an id whose heartbeat expired stays until the
        reaper (stages/router/worker_reaper.py) has moved its jobs to live workers."""
        return self._name("workers")

    def progress_stream(self, worker_id: str) -> str:
        """A worker's progress log (jobs/progress.py): the output ids each of its publishes
        carried, per job, written in the commit that publishes them; where a job that must
        resume (moved off the worker when it died) finds what it had published."""
        return self._name("progress", _require_id("worker_id", worker_id))

    def kv_events_stream(self) -> str:
        """The blocks the workers' prefix caches store and remove (jobs/kv_events.py)."""
        return self._name("kv-events")

    def reaping_key(self, worker_id: str) -> str:
        """A lock: the router replica moving a dead worker's jobs holds it."""
        return self._name("reaping", _require_id("worker_id", worker_id))

    def legacy_fence_key(self, worker_id: str) -> str:
        """Older workers' fence (a token they WATCH; the log is now, bus/fenced_stream.py):
        the reaper still changes it, fencing them in a rolling upgrade (routers first)."""
        return self._name("fence", _require_id("worker_id", worker_id))

    def routed_key(self) -> str:
        """A hash worker id -> jobs routed to it, so routers see each other's routing."""
        return self._name("routed")

    def request_key(self, request_id: str) -> str:
        """How many sub-requests (rids ``<request_id>-<i>``) one HTTP request made; set by
        the ingress that submitted it and deleted when they are done, so any ingress replica
        can abort it (``POST /v1/abort/<request_id>``)."""
        return self._name("request", request_id)

    def frontend_key(self, frontend_id: str) -> str:
        """Exists while ingress replica `frontend_id` is alive (refreshed every second): a
        stream it served can be resumed elsewhere only once it is gone."""
        return self._name("frontend", _require_id("frontend_id", frontend_id))

    def abort_key(self, rid: str) -> str:
        """Set when `rid` is aborted: a worker admitting its job drops it (bus/aborts.py)."""
        return self._name("abort", rid)


def env_variable(field_name: str) -> str:
    """The environment variable that sets ``field_name``."""
    return REDIS_URL_ENV if field_name == "redis_url" else ENV_PREFIX + field_name.upper()


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}; got {value!r}")


def _parse(variable: str, raw: str, type_name: object) -> Any:
    # With `from __future__ import annotations`, field types are the annotation strings.
    try:
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        if type_name == "bool":
            if raw.lower() not in _BOOLS:
                raise ValueError
            return _BOOLS[raw.lower()]
    except ValueError:
        raise ValueError(f"{variable} must be {type_name}; got {raw!r}") from None
    return raw
