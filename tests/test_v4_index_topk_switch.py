"""The C4 indexer's top-k through `dspark_kernels` (hook `v4_cpu_index_topk`, switch
`SGLANG_DSPARK_V4_KERNELS`), against SGLang's own torch top-k.

Inputs are SGLang's: logits from `fp8_paged_mqa_logits_torch` (what the CPU indexer scores
with) over an fp8 index cache, for a ragged verify batch (rows of one request at consecutive
positions, compressed lengths `(position + 1) // 4` from 0 to 131 over three scattered pages),
the padding rows `forward_c4_indexer` appends (length 1, page table 0), a row with `-inf`
logits (fewer finite than top-k: `-1` entries) and a row of logits tied across the top-k
boundary (0.0 and -0.0 among them). SGLang's function is the unhooked
`topk_transform_pytorch_vectorized`.

- `reference` (default): the same slots and positions as SGLang's, in the same order.
- `triton` (Triton's interpreter in a child pytest on CPU, compiled on a GPU): rows of at most
  top-k positions identical; selected rows the same positions where the top-k-th logit is not
  tied with one left out; across a tie the same logits, the kernel keeping the largest tied
  positions (torch's choice is unspecified).
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
from dspark_kernels import index_topk, kv_layout
from kernel_interpreter import DEVICE, GPU, direct, interpreter_test

from sglang_dspark.plugin import v4_cpu_index_topk

test_in_triton_interpreter = interpreter_test(__file__)

CPAGE = 64  # compressed positions per indexer page
HEADS = 8
TOPK = 16
# (prefix, verify length) per request: compressed lengths 0 (no history), 10..11 (whole rows),
# 25, 75..76 (two pages), 130..131 (three pages)
REQUESTS = [(0, 3), (40, 5), (100, 1), (300, 4), (520, 3)]
PADDING_ROWS = 2
INF_ROW, TIE_ROW = 14, 15  # rows of the last request (length 131): -inf logits, ties


def sglang_batch(topk: int = TOPK, requests=REQUESTS, seed: int = 0):
    """(logits `[R, W]` from SGLang's `fp8_paged_mqa_logits_torch`, seq_lens, page_table)."""
    from sglang.srt.layers.attention.dsv4.indexer import fp8_paged_mqa_logits_torch

    gen = torch.Generator().manual_seed(seed)
    seq_lens = [(p + i + 1) // 4 for p, n in requests for i in range(n)] + [1] * PADDING_ROWS
    pages = max(seq_lens) // CPAGE + 1
    perm = torch.randperm(4 * pages * len(requests), generator=gen).to(torch.int32)
    table = []
    for r, (_, n) in enumerate(requests):
        table += [perm[r * pages : (r + 1) * pages]] * n
    page_table = torch.stack(table + [torch.zeros(pages, dtype=torch.int32)] * PADDING_ROWS)
    cache = kv_layout.new_index_cache(perm.numel())
    slots = torch.arange(perm.numel() * CPAGE)
    codes = torch.randint(0, 0x7F, (slots.numel(), 128), generator=gen, dtype=torch.uint8)
    codes |= torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.uint8) << 7
    kv_layout.write_index_rows(cache, slots, codes, torch.rand(slots.numel(), generator=gen) + 0.5)
    rows = len(seq_lens)
    q = torch.randint(0, 0x7F, (rows, 1, HEADS, 128), generator=gen, dtype=torch.uint8)
    q |= torch.randint(0, 2, q.shape, generator=gen, dtype=torch.uint8) << 7
    weights = torch.randn(rows, HEADS, generator=gen) - 0.5  # many logits below SGLang's 0.0s
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    logits = fp8_paged_mqa_logits_torch(
        q.view(torch.float8_e4m3fn), cache.view(-1, CPAGE, 1, 132), weights, seq_lens,
        page_table, None, int(seq_lens.max()), False,
    )  # fmt: skip
    return logits, seq_lens, page_table


def shaped_batch():
    """`sglang_batch` with the `-inf` row (11 finite logits for 16 slots) and the tie row."""
    logits, seq_lens, page_table = sglang_batch()
    n = int(seq_lens[INF_ROW])
    logits[INF_ROW, 5 : n - 6] = float("-inf")
    tied = (logits[TIE_ROW] / logits[TIE_ROW].abs().max() * 3).round()
    tied[(tied == 0) & (torch.arange(tied.numel()) % 2 == 1)] = -0.0
    logits[TIE_ROW] = tied
    return logits, seq_lens, page_table


def sglang_topk(logits, seq_lens, page_table, topk: int = TOPK):
    """SGLang's torch top-k, unhooked: (slots, positions)."""
    from sglang.srt.layers.attention.dsv4 import indexer

    upstream = inspect.unwrap(indexer.topk_transform_pytorch_vectorized)
    slots = torch.empty(logits.shape[0], topk, dtype=torch.int32)
    raw = torch.empty_like(slots)
    upstream(logits, seq_lens, page_table, slots, CPAGE, raw)
    return slots, raw


def routed(logits, seq_lens, page_table, kernels: str, topk: int = TOPK, device: str = "cpu"):
    """The hook's call on `device`, outputs on the CPU."""
    logits, seq_lens, page_table = (t.to(device) for t in (logits, seq_lens, page_table))
    slots = torch.full((logits.shape[0], topk), 7, dtype=torch.int32, device=device)
    raw = torch.full_like(slots, 7)
    v4_cpu_index_topk.index_topk_transform(logits, seq_lens, page_table, slots, CPAGE, raw,
                                           kernels=kernels)  # fmt: skip
    return slots.cpu(), raw.cpu()


def boundary_tied(logits, seq_lens, r: int, topk: int = TOPK) -> bool:
    """Row `r` selects, and its top-k-th logit equals a logit left out."""
    n = int(seq_lens[r])
    top = logits[r, :n].topk(min(topk, n) + 1).values
    return n > topk and bool(top[topk - 1] == top[topk])


def assert_same_selection(got, want, logits, seq_lens, page_table, topk: int = TOPK):
    """The Triton route's contract against SGLang's torch top-k (see the module docstring)."""
    (got_slots, got_raw), (want_slots, want_raw) = got, want
    for r in range(logits.shape[0]):
        n = int(seq_lens[r])
        if n <= topk:
            assert torch.equal(got_raw[r], want_raw[r]), r
            assert torch.equal(got_slots[r], want_slots[r]), r
            continue
        g, w = got_raw[r].long(), want_raw[r].long()
        assert (g < 0).sum() == (w < 0).sum(), r
        assert torch.equal(got_slots[r] < 0, g < 0) and torch.equal(want_slots[r] < 0, w < 0), r
        slots = got_slots[r][g >= 0].long()
        g, w = g[g >= 0], w[w >= 0]
        assert int(g.max()) < n and g.unique().numel() == g.numel(), r
        assert torch.equal(slots, page_table[r].long()[g // CPAGE] * CPAGE + g % CPAGE), r
        values = logits[r]
        assert torch.equal(values[g].sort().values, values[w].sort().values), r
        if boundary_tied(logits, seq_lens, r, topk):
            kth = values[w].min()
            assert set((values[:n] > kth).nonzero().flatten().tolist()) <= set(g.tolist()), r
            tied = (values[:n] == kth).nonzero().flatten()
            kept = int((values[g] == kth).sum())
            assert set(g[values[g] == kth].tolist()) == set(tied[-kept:].tolist()), r
        else:
            assert set(g.tolist()) == set(w.tolist()), r


# ---------------------------------------------------------------------------- reference
def test_batch_has_every_row_kind():
    logits, seq_lens, page_table = shaped_batch()
    assert (seq_lens == 0).any() and ((seq_lens > 0) & (seq_lens <= TOPK)).any()
    assert (page_table[:, 1:] != page_table[:, :1]).any()  # rows over several pages
    assert (logits[INF_ROW, : seq_lens[INF_ROW]] > float("-inf")).sum() < TOPK
    assert boundary_tied(logits, seq_lens, TIE_ROW)
    assert (logits[TIE_ROW] == 0).any() and torch.signbit(logits[TIE_ROW]).any()
    # SGLang's logits are 0.0 past a row's length: row 8 (25 positions) has more than 25 - 16
    # negative logits, so an unmasked 0.0 would be selected
    assert int(seq_lens[8]) == 25 and (logits[8, 25:] == 0).all()
    assert (logits[8, :25] < 0).sum() > 25 - TOPK


@pytest.mark.parametrize("with_raw", [True, False], ids=["positions", "slots-only"])
def test_reference_route_is_sglangs_torch_topk(v4_switch, with_raw):
    """Default v4_switch, through the hook: SGLang's slots and positions, in SGLang's order,
    bit for bit (ties, -inf rows and padding included); SGLang's function is never called."""
    v4_switch(None)
    logits, seq_lens, page_table = shaped_batch()
    want_slots, want_raw = sglang_topk(logits, seq_lens, page_table)

    def upstream(*args, **kwargs):
        raise AssertionError("the CPU call reached SGLang's torch top-k")

    slots = torch.full_like(want_slots, 7)
    raw = torch.full_like(want_raw, 7) if with_raw else None
    v4_cpu_index_topk._topk_transform(upstream, logits, seq_lens, page_table, slots, CPAGE, raw)
    assert torch.equal(slots, want_slots)
    assert raw is None or torch.equal(raw, want_raw)
    assert (want_raw[INF_ROW] == -1).sum() == TOPK - 11 and (want_raw[-1, 1:] == -1).all()


def test_hook_calls_dspark_kernels_on_cpu_only(v4_switch, monkeypatch, caplog):
    """On CPU tensors the hook calls `dspark_kernels` (the call it logs once), off CPU SGLang's
    function: a hook that did not route would fail here."""
    v4_switch(None)
    calls = []
    reference = index_topk.topk_transform_reference
    monkeypatch.setattr(index_topk, "topk_transform_reference",
                        lambda *a, **k: calls.append(a[0].device.type) or reference(*a, **k))  # fmt: skip
    upstream_calls = []
    v4_cpu_index_topk._announce.cache_clear()
    logits, seq_lens, page_table = sglang_batch()
    for device in ("cpu", "meta", "cpu"):
        out = torch.empty(logits.shape[0], TOPK, dtype=torch.int32, device=device)
        with caplog.at_level(logging.INFO, logger=v4_cpu_index_topk.__name__):
            v4_cpu_index_topk._topk_transform(
                lambda *a: upstream_calls.append(a[0].device.type), logits.to(device),
                seq_lens.to(device), page_table.to(device), out, CPAGE, None,
            )  # fmt: skip
    assert calls == ["cpu", "cpu"] and upstream_calls == ["meta"]
    logged = [r.getMessage() for r in caplog.records if r.name == v4_cpu_index_topk.__name__]
    assert logged == [
        f"sglang-dspark: C4 indexer top-{TOPK} by dspark_kernels' topk_transform_reference"
    ]


def test_start_up_check_finds_a_caller_that_bypasses_the_hook(monkeypatch):
    from sglang.srt.layers.attention.dsv4.indexer import C4IndexerBackendMixin

    assert v4_cpu_index_topk._caller_reads_the_hooked_name() is None  # SGLang 0.5.23

    def forward_c4_indexer(self, *args, **kwargs):  # an upstream that selects elsewhere
        return torch.topk

    monkeypatch.setattr(C4IndexerBackendMixin, "forward_c4_indexer", forward_c4_indexer)
    problem = v4_cpu_index_topk._caller_reads_the_hooked_name()
    assert (
        problem and "no longer calls" in problem and "topk_transform_pytorch_vectorized" in problem
    )


# ------------------------------------------------------------------------------- triton
@pytest.fixture
def no_reference(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the triton route called the torch reference")

    monkeypatch.setattr(index_topk, "topk_transform_reference", forbidden)


@direct
def test_triton_route_selects_sglangs_positions(request):
    logits, seq_lens, page_table = shaped_batch()
    want = sglang_topk(logits, seq_lens, page_table)
    reference = routed(logits, seq_lens, page_table, "reference")
    request.getfixturevalue("no_reference")
    got = routed(logits, seq_lens, page_table, "triton", device=DEVICE)
    assert_same_selection(got, want, logits, seq_lens, page_table)
    assert_same_selection(got, reference, logits, seq_lens, page_table)
    # the tie row: the same logits as torch's choice, the largest tied positions
    assert boundary_tied(logits, seq_lens, TIE_ROW)
    # a selected row comes sorted by logit, then position, descending
    raw = got[1][TIE_ROW].long()
    keys = [(float(logits[TIE_ROW, p]), int(p)) for p in raw]
    assert keys == sorted(keys, reverse=True)


@direct
def test_triton_route_at_v4_top_512(request):
    """V4's width: 512 of up to 575 compressed positions (prompts past 2048 tokens)."""
    logits, seq_lens, page_table = sglang_batch(512, [(2040, 2), (2290, 3), (600, 1)], seed=1)
    want = sglang_topk(logits, seq_lens, page_table, 512)
    request.getfixturevalue("no_reference")
    got = routed(logits, seq_lens, page_table, "triton", topk=512, device=DEVICE)
    assert (seq_lens > 512).sum() >= 3
    assert_same_selection(got, want, logits, seq_lens, page_table, 512)


@direct
@pytest.mark.skipif(GPU, reason="the hook routes CPU tensors: on a GPU Triton is compiled")
def test_hook_follows_the_variable(v4_switch, monkeypatch):
    logits, seq_lens, page_table = shaped_batch()
    want = sglang_topk(logits, seq_lens, page_table)
    calls = []
    kernel = index_topk.topk_transform
    monkeypatch.setattr(index_topk, "topk_transform",
                        lambda *a, **k: calls.append(1) or kernel(*a, **k))  # fmt: skip
    for value in ("reference", "triton"):
        v4_switch(value)
        slots = torch.empty_like(want[0])
        raw = torch.empty_like(want[1])
        v4_cpu_index_topk._topk_transform(None, logits, seq_lens, page_table, slots, CPAGE, raw)
        if value == "reference":
            assert torch.equal(slots, want[0]) and torch.equal(raw, want[1]) and not calls
        else:
            assert calls == [1]
            assert_same_selection((slots, raw), want, logits, seq_lens, page_table)


@pytest.mark.skipif(not GPU, reason="the compiled variant needs a CUDA GPU; none on this machine")
def test_gpu_runs_the_topk_compiled():
    from triton.runtime.interpreter import InterpretedFunction

    assert DEVICE == "cuda"
    assert not isinstance(index_topk._topk_transform_kernel, InterpretedFunction)
