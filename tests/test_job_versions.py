"""A job's contract on the wire (jobs/requests.py): versioned by ``v``, ``priority`` a job
field beside ``sampling``. A job in the older form (no ``v``, priority inside ``sampling``)
still decodes and runs end to end from either stream a client may write; a version this code
does not know is refused with a 400 naming ``v`` and a dead letter; bad sampling in a direct
job is a 400 naming the field; the sampling map is written from checked parameters; and a
grammar is compiled by the worker alone, once per text."""

from __future__ import annotations

import json
import threading

import msgpack
import pytest
import redis

from bus.actor import Actor
from bus.client import new_request
from bus.reconnect import ensure_group
from jobs import grammar as job_grammar
from jobs.job_failures import malformed_reply
from jobs.protocol import (
    ENTRY_FIELD,
    ErrorReply,
    GenerateRequest,
    ProtocolError,
    TokenBatch,
    TokenizedRequest,
    decode,
    encode,
    pack_ids,
)
from jobs.requests import JOB_VERSION
from jobs.sampling_params import wire_sampling
from runtime.config import BusConfig
from stages.detokenizer.stage import DetokenizerStage
from stages.router.stage import RouterStage
from stages.tokenizer.stage import TokenizerStage
from tests.test_router_stage import _beat
from tests.worker_thread import published_entries

REPLY = "t:versions"
IDS = [1, 2, 3]


def _old(kind: str, rid: str, **sampling) -> dict:
    """A job as a client before version 2 wrote it: no `v`, priority inside sampling."""
    job = {"kind": kind, "rid": rid, "reply_to": REPLY, "input_ids": pack_ids(IDS),
           "sampling": {"max_new_tokens": 3, "temperature": 0, **sampling}}  # fmt: skip
    return job


def _packed(data: dict) -> bytes:
    return msgpack.packb(data, use_bin_type=True)


# ---- decode ----------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [GenerateRequest, TokenizedRequest])
def test_an_old_form_job_decodes_with_its_priority_lifted_beside_sampling(cls):
    job = decode(_packed(_old(cls.KIND, "r", priority=4)), cls)
    assert (job.priority, job.v) == (4, 1)  # its writer's version, for its replies
    assert job.sampling == {"max_new_tokens": 3, "temperature": 0}
    written = job.to_wire()  # passed on with priority beside sampling, its version kept
    assert written["v"] == 1 and written["priority"] == 4
    assert "priority" not in written["sampling"]
    assert decode(encode(job), cls) == job


@pytest.mark.parametrize("cls", [GenerateRequest, TokenizedRequest])
def test_a_current_form_job_round_trips(cls):
    job = cls("r", REPLY, input_ids=IDS, sampling={"temperature": 0.5}, priority=-3)
    assert decode(encode(job), cls) == job
    assert job.to_wire()["v"] == JOB_VERSION


@pytest.mark.parametrize("version", [JOB_VERSION + 1, 0, 99])
def test_a_version_this_code_does_not_know_is_refused_naming_v(version):
    payload = _packed({**_old("tokenized", "r"), "v": version})
    with pytest.raises(ProtocolError, match=f"job version {version} is not one") as caught:
        decode(payload, TokenizedRequest)
    assert caught.value.field == "v"
    reply_to, reply = malformed_reply(payload, caught.value)
    assert (reply_to, reply.status, reply.param) == (REPLY, 400, "v")
    assert f"version {version}" in reply.message


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"v": 2, "sampling": {"priority": 1}}, "priority is a job field since version 2"),
        ({"sampling": {"priority": 1}, "priority": 2}, "priority is given twice"),
        ({"priority": 2**40}, r"priority must be in \[-2\*\*31, 2\*\*31\)"),
        ({"sampling": {"priority": 2**40}}, r"priority must be in"),
    ],
    ids=["inside-sampling-of-v2", "both-ways", "job-field-huge", "old-form-huge"],
)
def test_a_priority_given_wrongly_is_refused_naming_priority(fields, match):
    data = {**_old("generate", "r"), **fields}
    with pytest.raises(ProtocolError, match=match) as caught:
        decode(_packed(data), GenerateRequest)
    assert caught.value.field == "priority"


# ---- where a job enters -------------------------------------------------------------------------


def test_the_sampling_map_is_written_from_the_checked_parameters():
    wire = wire_sampling({"stop": "\n", "logit_bias": {7: 1}, "temperature": 0,
                          "json_schema": {"type": "object"}, "top_k": None})  # fmt: skip
    assert wire == {"stop": ["\n"], "logit_bias": {"7": 1.0}, "temperature": 0.0,
                    "json_schema": '{"type":"object"}', "top_k": None}  # fmt: skip
    assert "max_new_tokens" not in wire  # not given: all that fit


def test_the_client_puts_priority_beside_sampling():
    job = new_request(REPLY, "Hi", sampling={"priority": 2, "temperature": 0})
    assert (job.priority, job.sampling, job.v) == (2, {"temperature": 0.0}, JOB_VERSION)
    assert new_request(REPLY, "Hi").priority is None


# ---- end to end: tokenizer, router, worker ------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from gpu_worker import Engine

    return Engine("random:tiny-llama", dtype="float32")


@pytest.fixture
def config(redis_url) -> BusConfig:
    return BusConfig(redis_url=redis_url, block_ms=5, no_worker_timeout_s=0.5)


class Chain:
    """The tokenizer and router stages and one worker, stepped by hand in this process."""

    def __init__(self, engine, client: redis.Redis, config: BusConfig) -> None:
        from gpu_worker.worker import Worker

        self.client, self.config = client, config
        stop = threading.Event()
        tokenizer = TokenizerStage(config, tokenizer=None)
        router = RouterStage(config, client, stop)
        for stage in (tokenizer, router):
            ensure_group(client, stage.input_stream(config), stage.group)
        self.stages = [Actor(client, config, tokenizer, stop), Actor(client, config, router, stop)]
        self.worker = Worker(engine, client, config, "v", "random:tiny-llama")
        self.worker._inbox = self.worker.bus.open()
        _beat(client, config, "v")

    def write(self, stream: str, payload: bytes) -> None:
        self.client.xadd(stream, {ENTRY_FIELD: payload})

    def run(self, turns: int = 200) -> None:
        for stage in self.stages:
            stage.run_once()
        for _ in range(turns):
            self.worker._turn()
            if not self.worker.jobs and not self.worker._inbox:
                return
        raise AssertionError(f"jobs still running: {list(self.worker.jobs)}")

    def outputs(self) -> dict[str, list[int] | ErrorReply]:
        outputs: dict[str, list[int] | ErrorReply] = {}
        for _, fields in published_entries(self.client, self.config):
            for item in decode(fields[ENTRY_FIELD], TokenBatch).items:
                outputs.setdefault(item.rid, []).extend(item.ids)
        for _, fields in self.client.xrange(REPLY):
            reply = decode(fields[ENTRY_FIELD], ErrorReply)
            outputs[reply.rid] = reply
        return outputs

    def dead_letters(self) -> list[dict]:
        return [fields for _, fields in self.client.xrange(self.config.dead_letter_stream())]


def _decoded(entry) -> TokenizedRequest:
    return decode(entry[1][ENTRY_FIELD], TokenizedRequest)


@pytest.fixture
def chain(engine, redis_client, config) -> Chain:
    return Chain(engine, redis_client, config)


@pytest.mark.parametrize("stream", ["requests", "tokenized"])
def test_old_and_new_form_direct_jobs_run_end_to_end(chain, config, stream, monkeypatch):
    kind = "generate" if stream == "requests" else "tokenized"
    target = config.requests_stream() if stream == "requests" else config.tokenized_stream()
    seen: dict[str, int] = {}  # rid -> the priority the worker scheduled it at
    add = chain.worker.scheduler.add_request

    def add_request(req) -> None:
        seen[req.rid] = req.priority
        add(req)

    monkeypatch.setattr(chain.worker.scheduler, "add_request", add_request)
    chain.write(target, _packed(_old(kind, "old", priority=3)))
    new = {**_old(kind, "new"), "v": JOB_VERSION, "priority": 2}
    chain.write(target, _packed(new))
    for stage in chain.stages:
        stage.run_once()
    routed = {job.rid: job for job in map(_decoded, chain.client.xrange(config.worker_stream("v")))}
    assert {rid: (job.v, job.priority) for rid, job in routed.items()} == {
        "old": (1, 3),
        "new": (JOB_VERSION, 2),
    }  # each keeps its writer's version
    chain.run()
    outputs = chain.outputs()
    assert len(outputs["old"]) == 3 and len(outputs["new"]) == 3
    assert seen == {"old": 3, "new": 2}  # the worker schedules at the job's priority
    assert chain.dead_letters() == []


def test_each_requester_reads_its_replies_in_its_own_version(chain, config):
    """An older client (no v) gets a delta's finish as the list it knows; a current one the
    record by name."""
    chain.write(config.tokenized_stream(), _packed(_old("tokenized", "old")))
    new = {**_old("tokenized", "new"), "v": JOB_VERSION}
    chain.write(config.tokenized_stream(), _packed(new))
    chain.run()
    last = {}
    for _, fields in published_entries(chain.client, config):
        for item in decode(fields[ENTRY_FIELD], TokenBatch).items:
            last[item.rid] = item
    assert {rid: item.reply_version for rid, item in last.items()} == {"old": 1, "new": 2}
    detokenizer = DetokenizerStage(config, tokenizer=None)
    finishes = {
        rid: detokenizer._delta(item, None).to_wire()["finish"] for rid, item in last.items()
    }
    assert finishes["old"][:4] == ["length", None, 3, 3] and len(finishes["old"]) == 5
    assert {name: finishes["new"][name] for name in ("reason", "prompt_tokens",
            "completion_tokens")} == {"reason": "length", "prompt_tokens": 3,
                                      "completion_tokens": 3}  # fmt: skip


def test_an_unknown_version_gets_a_400_naming_v_and_a_dead_letter(chain, config):
    chain.write(config.requests_stream(), _packed({**_old("generate", "future"), "v": 9}))
    chain.run()
    error = chain.outputs()["future"]
    assert isinstance(error, ErrorReply) and (error.status, error.param) == (400, "v")
    assert "job version 9" in error.message
    (dead,) = chain.dead_letters()
    assert b"job version 9" in dead[b"reason"]


@pytest.mark.parametrize("stream", ["requests", "tokenized"])
def test_bad_sampling_in_a_direct_job_is_a_400_naming_the_field(chain, config, stream):
    kind = "generate" if stream == "requests" else "tokenized"
    target = config.requests_stream() if stream == "requests" else config.tokenized_stream()
    chain.write(target, _packed(_old(kind, "hot", temperature="hot")))
    chain.write(target, _packed(_old(kind, "range", top_p=5.0)))
    chain.run()
    outputs = chain.outputs()
    for rid, param in (("hot", "temperature"), ("range", "top_p")):
        error = outputs[rid]
        assert isinstance(error, ErrorReply) and (error.status, error.param) == (400, param)
        assert error.message.startswith(param)


# ---- a grammar is compiled by the worker, once -----------------------------------------------


def test_no_stage_between_ingress_and_worker_compiles_a_grammar(chain, config, monkeypatch):
    compiles: list[str] = []  # every compile, whoever calls it, goes through _compiled
    monkeypatch.setattr(job_grammar, "_compiled",
                        lambda name, spec: compiles.append(name) or ("", None))  # fmt: skip
    schema = json.dumps({"type": "object", "properties": {"never_compiled": {}}})
    chain.write(config.requests_stream(), _packed(_old("generate", "g", json_schema=schema)))
    for stage in chain.stages:
        stage.run_once()
    (entry,) = chain.client.xrange(config.worker_stream("v"))
    assert decode(entry[1][ENTRY_FIELD], TokenizedRequest).sampling["json_schema"] == schema
    assert compiles == []


def test_a_worker_compiles_a_grammar_text_once(redis_client, redis_url):
    from gpu_worker import Engine
    from gpu_worker.sampling import grammar as worker_grammar
    from gpu_worker.worker import Worker

    config = BusConfig(redis_url=redis_url, block_ms=5)
    model = "smollm2-135m-instruct"
    worker = Worker(Engine(model, dtype="float32"), redis_client, config, "g1", model)
    worker._inbox = worker.bus.open()
    compiled: list[str] = []
    template = worker_grammar._template

    def counted(tokenizer, field, spec):
        compiled.append(spec)
        return template(tokenizer, field, spec)

    schema = json.dumps({"type": "object", "properties": {"once_only": {"type": "integer"}},
                         "required": ["once_only"]})  # fmt: skip
    original = worker_grammar._template
    worker_grammar._template = counted
    try:
        for rid in ("a", "b", "c"):
            job = TokenizedRequest(rid, REPLY, IDS, {"max_new_tokens": 4, "json_schema": schema})
            redis_client.xadd(worker.bus.stream, {ENTRY_FIELD: encode(job)})
            for _ in range(400):
                worker._turn()
                if not worker.jobs and not len(worker.grammar_waits) and not worker._inbox:
                    break
    finally:
        worker_grammar._template = original
    assert compiled == [json.dumps(json.loads(schema), separators=(",", ":"))]  # normal form
    assert not redis_client.exists(REPLY)  # no job was refused
