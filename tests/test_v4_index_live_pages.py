"""The C4 indexer's logits on CPU from the live pages only (hook `v4_cpu_index_live_pages`),
against SGLang's `fp8_paged_mqa_logits_torch` over the whole page table.

The batches are shaped as the tiny V4's server builds them: a page table as wide as the
context allows (258 pages) under rows that read a few compressed positions (a verify batch of
24 rows, 0 to 3 positions), prefill rows reading up to 600 positions over ten pages, and a
batch whose rows read nothing yet.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from dspark_kernels import kv_layout

from sglang_dspark.plugin import v4_cpu_index_pages

CPAGE = 64  # compressed positions per indexer page
HEADS = 64
POOL_PAGES = 36
WIDTH = 258  # the tiny V4's page-table width: 16 512 compressed positions


def upstream():
    from sglang.srt.layers.attention.dsv4 import indexer

    return inspect.unwrap(indexer.fp8_paged_mqa_logits_torch)


def _fp8(shape, gen) -> torch.Tensor:
    """Random finite e4m3 codes (0x7f / 0xff are NaN)."""
    codes = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8)
    codes |= torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7
    return codes.view(torch.float8_e4m3fn)


def batch(seq_lens: list[int], width: int = WIDTH, seed: int = 0):
    """(q, cache, weights, seq_lens, page_table): every column a page of the pool."""
    gen = torch.Generator().manual_seed(seed)
    cache = kv_layout.new_index_cache(POOL_PAGES)
    slots = torch.arange(POOL_PAGES * CPAGE)
    codes = _fp8((slots.numel(), 128), gen).view(torch.uint8)
    kv_layout.write_index_rows(cache, slots, codes, torch.rand(slots.numel(), generator=gen) + 0.5)
    rows = len(seq_lens)
    page_table = torch.randint(0, POOL_PAGES, (rows, width), generator=gen, dtype=torch.int32)
    weights = torch.randn(rows, HEADS, generator=gen)
    q = _fp8((rows, 1, HEADS, 128), gen)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, cache.view(-1, CPAGE, 1, 132), weights, seq_lens, page_table


VERIFY = [0, 1, 1, 2, 2, 2] + [3] * 18  # 4 requests x 6 rows
PREFILL = [(i + 1) // 4 for i in range(0, 2400, 80)] + [600]  # 0 .. 600: ten pages
EMPTY = [0, 0, 0]


@pytest.mark.parametrize("lens", [VERIFY, PREFILL, EMPTY], ids=["verify", "prefill", "empty"])
@pytest.mark.parametrize("max_seq_len", ["tight", 16512])
def test_live_pages_give_sglangs_logits_bit_for_bit(lens, max_seq_len):
    q, cache, weights, seq_lens, page_table = batch(lens)
    width = int(seq_lens.max()) if max_seq_len == "tight" else max_seq_len
    want = upstream()(q, cache, weights, seq_lens, page_table, None, width, False)
    seen = []

    def spy(*args):
        seen.append(args[4].shape[1])
        return upstream()(*args)

    got = v4_cpu_index_pages._live_pages_only(
        spy, q, cache, weights, seq_lens, page_table, None, width, False
    )
    assert seen == [max(1, -(-max(lens) // CPAGE))]  # 1, 10, 1 of 258 columns
    assert got.shape == want.shape and torch.equal(got, want)
    assert want[seq_lens[:, None] <= torch.arange(want.shape[1])].eq(0).all()
    assert got.abs().sum() > 0 or max(lens) == 0


def test_columns_past_every_rows_length_are_not_read():
    """Pages past the live ones hold an id outside the pool: SGLang's function gathers them
    (an IndexError), the hook never does, and its logits are those of a valid table."""
    q, cache, weights, seq_lens, page_table = batch(VERIFY)
    poisoned = page_table.clone()
    poisoned[:, 1:] = 10**6
    with pytest.raises(IndexError):
        upstream()(q, cache, weights, seq_lens, poisoned, None, 16512, False)
    got = v4_cpu_index_pages._live_pages_only(
        upstream(), q, cache, weights, seq_lens, poisoned, None, 16512, False
    )
    want = upstream()(q, cache, weights, seq_lens, page_table, None, 16512, False)
    assert torch.equal(got, want)


def test_other_devices_get_the_whole_table():
    seen = []
    page_table = torch.zeros(2, WIDTH, dtype=torch.int32, device="meta")
    seq_lens = torch.ones(2, dtype=torch.int32, device="meta")
    cache = torch.zeros(4, CPAGE, 1, 132, dtype=torch.uint8, device="meta")
    v4_cpu_index_pages._live_pages_only(
        lambda *a: seen.append(a[4].shape), None, cache, None, seq_lens, page_table, None, 64, False
    )
    assert seen == [page_table.shape]


def test_start_up_check_finds_an_indexer_that_scores_elsewhere(monkeypatch):
    from sglang.srt.layers.attention.dsv4.indexer import C4IndexerBackendMixin

    assert v4_cpu_index_pages._caller_reads_the_hooked_name() is None  # SGLang 0.5.23

    def forward_c4_indexer(self, *args, **kwargs):  # an upstream that scores elsewhere
        return torch.bmm

    monkeypatch.setattr(C4IndexerBackendMixin, "forward_c4_indexer", forward_c4_indexer)
    problem = v4_cpu_index_pages._caller_reads_the_hooked_name()
    assert problem and "no longer calls" in problem and "fp8_paged_mqa_logits_torch" in problem
