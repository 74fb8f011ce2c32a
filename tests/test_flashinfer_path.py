"""The FlashInfer path without a GPU: its page table, the pool views and the backend around
the kernel, with the plain-torch reference kernel in FlashInfer's place."""

from __future__ import annotations

import random

import pytest
import torch

from gpu_worker import Engine
from gpu_worker.attention import registry
from gpu_worker.attention.flashinfer_backend import flashinfer_reference_backend
from gpu_worker.attention.layer import PagedAttention
from gpu_worker.attention.paged_metadata import build_paged_kv_metadata, paged_kv_view
from gpu_worker.attention.registry import resolve_backend_name
from gpu_worker.attention.torch_native import TorchNativeAttnBackend
from gpu_worker.memory.kv_pool import TokenToKVPool
from gpu_worker.memory.req_to_token_pool import ReqToTokenPool
from gpu_worker.model_executor.forward_batch import ForwardBatch, ForwardMode
from gpu_worker.models.random_shapes import fill_random_weights


def test_page_table_of_a_hand_built_batch():
    page_size = 4
    table = torch.zeros(3, 16, dtype=torch.int64)
    # Request in row 2: 9 keys on pages 5, 2, 7; request in row 0: 4 keys on page 3.
    for position in range(9):
        table[2, position] = [5, 2, 7][position // 4] * 4 + position % 4
    table[0, :4] = torch.arange(12, 16)
    meta = build_paged_kv_metadata(table, torch.tensor([2, 0]), [9, 4], [3, 1], page_size)
    assert meta.qo_indptr.tolist() == [0, 3, 4]
    assert meta.kv_indptr.tolist() == [0, 3, 4]
    assert meta.kv_indices.tolist() == [5, 2, 7, 3]
    assert meta.kv_last_page_len.tolist() == [1, 4]  # a full last page holds page_size keys
    assert {t.dtype for t in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices)} == {torch.int32}


def test_metadata_refuses_inconsistent_lengths():
    table = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match="one entry per request"):
        build_paged_kv_metadata(table, torch.tensor([0, 1]), [3], [1], 1)
    with pytest.raises(ValueError, match="query rows"):
        build_paged_kv_metadata(table, torch.tensor([0]), [3], [4], 1)


def test_paged_view_reads_the_pool_in_place():
    pool = torch.randn(3, 8 * 4, 16)  # [kv_heads, slots, head_dim], page_size 4
    pages = paged_kv_view(pool, 4)
    assert pages.shape == (8, 4, 3, 16)
    assert pages.data_ptr() == pool.data_ptr()  # a view: nothing copied per step
    assert torch.equal(pages[5, 2, 1], pool[1, 5 * 4 + 2])


def _random_batch(rng, page_size, mode, kv_heads=2, heads=6, dim=16):
    """A batch over pages handed out in random order; prefixes already in the pool."""
    num_pages = 1024 // page_size
    pool = TokenToKVPool(num_pages * page_size, page_size, torch.float32, 1, kv_heads, dim, "cpu")
    pool.k_buffer[0].normal_()
    pool.v_buffer[0].normal_()
    rows = ReqToTokenPool(8, 512, "cpu")
    free_pages = list(range(1, num_pages + 1))  # page 0 is the padding page
    rng.shuffle(free_pages)
    bs = rng.randint(1, 6)
    prefix_lens = [rng.choice([0, 1, page_size, rng.randint(0, 90)]) for _ in range(bs)]
    if mode == ForwardMode.DECODE:
        prefix_lens = [max(p, 1) for p in prefix_lens]
        new_lens = [1] * bs
    else:
        new_lens = [rng.choice([1, rng.randint(1, 40)]) for _ in range(bs)]
    row_ids = rng.sample(range(8), bs)
    out_loc = []
    for row, prefix, new in zip(row_ids, prefix_lens, new_lens, strict=True):
        total = prefix + new
        pages = [free_pages.pop() for _ in range(-(-total // page_size))]
        slots = [pages[p // page_size] * page_size + p % page_size for p in range(total)]
        rows.req_to_token[row, :total] = torch.tensor(slots)
        out_loc += slots[prefix:]
    seq_lens = [p + n for p, n in zip(prefix_lens, new_lens, strict=True)]
    tokens = sum(new_lens)
    spans = zip(prefix_lens, seq_lens, strict=True)
    batch = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.cat([torch.arange(start, stop) for start, stop in spans]),
        req_pool_indices=torch.tensor(row_ids),
        seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.tensor(out_loc),
        seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=new_lens,
        extend_prefix_lens_cpu=prefix_lens,
    )
    layer = PagedAttention(0, heads, kv_heads, dim, scaling=dim**-0.5)
    qkv = [torch.randn(tokens, n * dim) for n in (heads, kv_heads, kv_heads)]
    return pool, rows, batch, layer, qkv


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.EXTEND])
def test_reference_over_the_page_table_equals_torch_native(page_size, mode):
    """Random batches: pages in random order, prefixes (none, one key, a full page, any),
    chunk-like extends after a prefix, one-token rows riding along in an extend."""
    rng = random.Random(page_size * 10 + int(mode))
    for _ in range(10):
        pool, rows, batch, layer, (q, k, v) = _random_batch(rng, page_size, mode)
        outputs = []
        for backend in (
            TorchNativeAttnBackend(rows, pool),
            flashinfer_reference_backend(rows, pool),
        ):
            backend.prepare_metadata(batch)
            outputs.append(backend.forward(q, k, v, layer, batch))
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5)


def test_auto_picks_flashinfer_on_cuda_only_where_it_is_installed(monkeypatch, caplog):
    cuda = torch.device("cuda")
    installed = {"flashinfer": True}
    monkeypatch.setattr(
        registry.importlib.util, "find_spec", lambda name: object() if installed[name] else None
    )
    assert resolve_backend_name("auto", cuda, cpu_kernels=False) == "flashinfer"
    assert resolve_backend_name("auto", torch.device("cpu"), cpu_kernels=True) == "cpu_kernel"
    assert not caplog.records
    installed["flashinfer"] = False
    assert resolve_backend_name("auto", cuda, cpu_kernels=False) == "torch_native"
    # A CUDA worker without FlashInfer decodes eager, several times slower: said, with the fix.
    (warning,) = caplog.records
    assert warning.levelname == "WARNING" and "streamserve[gpu]" in warning.getMessage()


def test_flashinfer_needs_cuda_and_says_what_runs_instead():
    with pytest.raises(ValueError, match="flashinfer_reference"):
        resolve_backend_name("flashinfer", torch.device("cpu"), cpu_kernels=True)
    assert resolve_backend_name("flashinfer_reference", torch.device("cpu"), True) == (
        "flashinfer_reference"
    )


@pytest.mark.parametrize(
    "options",
    [{"page_size": 16, "chunked_prefill_size": 24}, {"speculative": "ngram"}],
    ids=["pages-chunked", "ngram-verify"],
)
def test_engine_on_the_flashinfer_path_equals_torch_native(options):
    """float32 greedy through the whole FlashInfer path, draft verification included."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 5, 17, 40, 3, 60)]
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    outputs = {}
    for backend in ("torch_native", "flashinfer_reference"):
        engine = Engine("random:tiny-llama", dtype="float32", attention_backend=backend, **options)
        fill_random_weights(engine.runner.model, seed=0, std=0.2)
        outputs[backend] = [
            r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=params)
        ]
    assert outputs["flashinfer_reference"] == outputs["torch_native"]
