"""V4's sparse attention on CPU (hook `v4_cpu_sparse_attention`) reads only the valid slots.

A decode or verify row early in a sequence has few valid slots of its `K` (window 128, the C4
layer's compressed top-512): SGLang's row reader gathered every one of them, clamping `-1` to
slot 0, and the attention zeroed the invalid rows afterwards. The hook gathers the valid slots
only; its output and log-sum-exp equal those of the whole gather bit for bit (the same zeros
reach the same float32 arithmetic).
"""

from __future__ import annotations

import pytest
import torch
from dspark_kernels import kv_layout

from sglang_dspark.plugin import v4_cpu_attention

SWA_PAGE, EXTRA_PAGE, HEADS = 256, 64, 8


def _cache(pages: int, page: int, gen) -> torch.Tensor:
    """A V4 cache in SGLang's `[pages, page, 1, 584]` view, every slot written."""
    cache = kv_layout.new_v4_cache(pages, page)
    n = pages * page
    codes = torch.randint(0, 0x7F, (n, 448), generator=gen, dtype=torch.uint8)
    codes |= torch.randint(0, 2, codes.shape, generator=gen, dtype=torch.uint8) << 7
    exponents = torch.randint(120, 130, (n, 7), generator=gen, dtype=torch.uint8)
    rope = torch.randn(n, 64, generator=gen)
    kv_layout.write_v4_rows(cache, torch.arange(n), codes, exponents, rope, page)
    return cache[:, : page * 584].view(pages, page, 1, 584)


def _indices(rows: int, k: int, slots: int, gen) -> torch.Tensor:
    """Per row a valid prefix of random length (0 to k) of slots, `-1` after it, and a few `-1`
    inside it (SGLang's window rows past a request's start)."""
    idx = torch.randint(0, slots, (rows, 1, k), generator=gen, dtype=torch.int32)
    lengths = torch.randint(0, k + 1, (rows,), generator=gen)
    idx[torch.arange(k)[None, None, :] >= lengths[:, None, None]] = -1
    idx[:, :, 3] = -1
    return idx


def _whole_gather(k_cache, indices, topk_length):
    """The reader as SGLang's: every slot gathered, `-1` clamped to slot 0."""
    from sglang.kernels.ops.attention.flash_mla_sm120 import _gather_and_dequant

    invalid = indices < 0
    if topk_length is not None:
        k = torch.arange(indices.shape[-1]).view(1, 1, -1)
        invalid = invalid | (k >= topk_length.view(-1, 1, 1))
    return _gather_and_dequant(k_cache, indices.clamp(min=0), k_cache.shape[1]), invalid


@pytest.mark.parametrize("rows", [1, 24, 40])  # 40: two query chunks
@pytest.mark.parametrize("extra", [False, True], ids=["window", "window+c4"])
def test_valid_slots_only_give_the_whole_gathers_attention_bit_for_bit(rows, extra, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    swa, c4 = _cache(2, SWA_PAGE, gen), _cache(4, EXTRA_PAGE, gen)
    q = torch.randn(rows, 1, HEADS, 512, generator=gen).to(torch.bfloat16)
    sink = torch.randn(HEADS, generator=gen)
    idx = _indices(rows, 128, 2 * SWA_PAGE, gen)
    lens = torch.randint(0, 129, (rows,), generator=gen)
    kwargs = {"q": q, "k_cache": swa, "indices": idx, "topk_length": lens, "attn_sink": sink,
              "head_dim_v": 512, "softmax_scale": 512**-0.5}  # fmt: skip
    if extra:
        kwargs["extra_k_cache"] = c4
        kwargs["extra_indices_in_kvcache"] = _indices(rows, 512, 4 * EXTRA_PAGE, gen)
        kwargs["extra_topk_length"] = torch.randint(0, 513, (rows,), generator=gen)
    got = v4_cpu_attention.flash_mla_with_kvcache_torch(**kwargs)
    monkeypatch.setattr(v4_cpu_attention, "_slots", _whole_gather)
    want = v4_cpu_attention.flash_mla_with_kvcache_torch(**kwargs)
    assert got[0].dtype == torch.bfloat16 and got[0].abs().sum() > 0
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_only_the_valid_slots_are_read(monkeypatch):
    from sglang.kernels.ops.attention import flash_mla_sm120

    gen = torch.Generator().manual_seed(0)
    swa = _cache(1, SWA_PAGE, gen)
    idx = _indices(6, 128, SWA_PAGE, gen)
    lens = torch.tensor([0, 5, 128, 128, 60, 1])
    read = []
    reader = flash_mla_sm120._gather_and_dequant
    monkeypatch.setattr(flash_mla_sm120, "_gather_and_dequant",
                        lambda c, i, p: read.append(i.clone()) or reader(c, i, p))  # fmt: skip
    kv, invalid = v4_cpu_attention._slots(swa, idx, lens)
    valid = (idx >= 0) & (torch.arange(128)[None, None] < lens[:, None, None])
    assert torch.equal(invalid, ~valid)
    assert len(read) == 1 and torch.equal(read[0], idx[valid])
    assert kv[invalid].eq(0).all()
    assert torch.equal(kv[valid], reader(swa, idx[valid], SWA_PAGE))

    read.clear()
    _, invalid = v4_cpu_attention._slots(swa, torch.full((2, 1, 128), -1), None)
    assert invalid.all() and not read  # nothing valid: nothing read
