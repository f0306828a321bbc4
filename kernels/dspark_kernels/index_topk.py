"""Ragged paged fp8 index logits fused with the per-row top-k (the C4 indexer's selection).

Each row is one verify token (`rows_per_request=1`): its own compressed length `seq_lens[r]`
(`(position + 1) // 4`, 0 when the request has no compressed history yet) and its own page table
row. Shapes: `q_fp8` `[R, H, 128]` float8_e4m3fn, `weights` `[R, H]` (or `[R, H, 1]`) float32
(already multiplied by the query scale, as `indexer_query` returns them), `index_cache` uint8
`[num_pages, 64 * 132]` (see `kv_layout`), `seq_lens` `[R]`, `page_table` `[R, max_pages]`
(compressed page `p` of the row's request is physical page `page_table[r, p]`).

logits[r, c] = sum_h relu(q[r, h] . k[c]) * weights[r, h] * k_scale[c]   for c < seq_lens[r]

as DeepGEMM's `fp8_paged_mqa_logits` computes it (fp8 products, float32 accumulation; SGLang's
torch fallback `fp8_paged_mqa_logits_torch` in `srt/layers/attention/dsv4/indexer.py` is the same
formula but rounds through bf16). Selection follows `topk_transform_paged`
(`topk_v1.cuh`; torch twin `topk_transform_pytorch_vectorized`): a row with `seq_len <= topk`
takes positions `0 .. seq_len - 1` in order, otherwise the `topk` largest logits, in no particular
order; a position `i` is written as its pool slot `page_table[r, i // 64] * 64 + i % 64` and `-1`
fills the rest.

The Triton kernel never writes the logits: one program per row streams the row's compressed
tokens in chunks of `topk`, scores a chunk with fp8 `tl.dot`, packs (score, position) into int64
keys and keeps the best `topk` by a bitonic merge (running best sorted descending, chunk sorted
ascending, elementwise max, sort).

The selection alone, over logits already computed (SGLang's CPU serving path computes them with
`fp8_paged_mqa_logits_torch`, in bf16): `topk_transform` (Triton, the same merge over a row of
`scores`) and `topk_transform_reference` (torch: `topk_transform_pytorch_vectorized`'s own
`torch.topk(sorted=False)` call on the same masked scores, so the same positions in the same
order). `scores` `[R, W]` holds row `r`'s logit of compressed position `c` at `[r, c]`; values
at `c >= seq_lens[r]` are ignored, a selected `-inf` logit is written as `-1` (as SGLang does).
Both select the same positions wherever a row's `topk`-th largest logit is not tied with a
logit left out. Among logits tied across that boundary the kernel keeps the largest positions
(-0.0 counts as 0.0); `torch.topk` keeps whichever its CPU selection (libstdc++'s
`nth_element` / `partial_sort`) leaves in front: unspecified, as the order of a selected row is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_layout import INDEX_HEAD_DIM, INDEX_PAGE_SIZE, index_page_bytes, read_index_rows
from .numerics import e4m3_value_torch

_INT64_MIN = -(2**63)


@triton.jit
def _keep_best(best, score, idx, valid):
    """Merge a chunk of (float32 `score`, position `idx`) into `best`, the running top keys
    sorted descending; invalid entries never enter. A key orders by score, then by position
    (the larger first): the float32 bits made monotonic as int32 in bits 63..32, the position
    in bits 31..0."""
    score = tl.where(score == 0.0, 0.0, score)  # -0.0 ties with 0.0, as in torch
    bits = score.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = (ordered.to(tl.int64) << 32) | idx
    packed = tl.where(valid, packed, -(2**63))
    return tl.sort(tl.maximum(best, tl.sort(packed)), descending=True)


@triton.jit
def _index_topk_kernel(
    Q,
    W,
    CACHE,
    CACHE32,
    SEQ,
    PT,
    pt_stride,
    OUT,
    RAW,
    H: tl.constexpr,
    HEAD_GROUP: tl.constexpr,
    TOPK: tl.constexpr,
    PAGE: tl.constexpr,
    WRITE_RAW: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seq = tl.load(SEQ + row).to(tl.int64)
    k = tl.arange(0, TOPK)
    if seq <= TOPK:
        valid = k < seq
        page = tl.load(PT + row * pt_stride + k // PAGE, mask=valid, other=0).to(tl.int64)
        tl.store(OUT + row * TOPK + k, tl.where(valid, page * PAGE + k % PAGE, -1).to(tl.int32))
        if WRITE_RAW:
            tl.store(RAW + row * TOPK + k, tl.where(valid, k, -1).to(tl.int32))
        return

    d = tl.arange(0, 128)
    best = tl.full([TOPK], -(2**63), tl.int64)
    for start in range(0, seq, TOPK):
        idx = start + k
        valid = idx < seq
        page = tl.load(PT + row * pt_stride + idx // PAGE, mask=valid, other=0).to(tl.int64)
        base = page * (PAGE * 132)
        slot = idx % PAGE
        keys = tl.load(
            CACHE + base[:, None] + slot[:, None] * 128 + d[None, :], mask=valid[:, None]
        )
        keys = keys.to(tl.float8e4nv, bitcast=True)
        score = tl.zeros([TOPK], tl.float32)
        for h0 in tl.static_range(0, H, HEAD_GROUP):
            head = h0 + tl.arange(0, HEAD_GROUP)
            q = tl.load(Q + (row * H + head[:, None]) * 128 + d[None, :], mask=head[:, None] < H)
            dots = tl.dot(keys, tl.trans(q.to(tl.float8e4nv, bitcast=True)))
            w = tl.load(W + row * H + head, mask=head < H, other=0.0)
            score += tl.sum(tl.maximum(dots, 0.0) * w[None, :], axis=1)
        k_scale = tl.load(CACHE32 + (base + PAGE * 128) // 4 + slot, mask=valid, other=0.0)
        score = score * k_scale
        best = _keep_best(best, score, idx, valid)

    raw = (best & 0xFFFFFFFF).to(tl.int64)
    page = tl.load(PT + row * pt_stride + raw // PAGE).to(tl.int64)
    tl.store(OUT + row * TOPK + k, (page * PAGE + raw % PAGE).to(tl.int32))
    if WRITE_RAW:
        tl.store(RAW + row * TOPK + k, raw.to(tl.int32))


@triton.jit
def _topk_transform_kernel(
    SCORES,
    s_stride,
    width,
    SEQ,
    PT,
    pt_stride,
    OUT,
    RAW,
    TOPK: tl.constexpr,
    BLOCK: tl.constexpr,
    PAGE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    seq = tl.load(SEQ + row).to(tl.int64)
    k = tl.arange(0, BLOCK)
    out = k < TOPK
    if seq <= TOPK:
        valid = k < seq
        page = tl.load(PT + row * pt_stride + k // PAGE, mask=valid, other=0).to(tl.int64)
        tl.store(OUT + row * TOPK + k, tl.where(valid, page * PAGE + k % PAGE, -1).to(tl.int32),
                 mask=out)  # fmt: skip
        tl.store(RAW + row * TOPK + k, tl.where(valid, k, -1).to(tl.int32), mask=out)
        return

    n = tl.minimum(seq, width)
    best = tl.full([BLOCK], -(2**63), tl.int64)
    for start in range(0, n, BLOCK):
        idx = start + k
        valid = idx < n
        score = tl.load(SCORES + row * s_stride + idx, mask=valid, other=0.0).to(tl.float32)
        best = _keep_best(best, score, idx, valid)

    # a chunk entry, and not a -inf logit: -2139095041 is a -inf key's bits 63..32
    # (0xFF800000 ^ 0x7FFFFFFF as int32); an empty slot's are -2**31
    valid = (best >> 32) > -2139095041
    raw = tl.where(valid, best & 0xFFFFFFFF, 0)
    page = tl.load(PT + row * pt_stride + raw // PAGE, mask=valid & out, other=0).to(tl.int64)
    tl.store(OUT + row * TOPK + k, tl.where(valid, page * PAGE + raw % PAGE, -1).to(tl.int32),
             mask=out)  # fmt: skip
    tl.store(RAW + row * TOPK + k, tl.where(valid, raw, -1).to(tl.int32), mask=out)


def _check_inputs(q_fp8, weights, index_cache, seq_lens, page_table, page_size):
    if q_fp8.ndim != 3 or q_fp8.shape[2] != INDEX_HEAD_DIM:
        raise ValueError(f"q_fp8 must be [R, H, 128], got {tuple(q_fp8.shape)}")
    rows, heads, _ = q_fp8.shape
    weights = weights.reshape(rows, heads).float().contiguous()
    if index_cache.dtype != torch.uint8 or index_cache.shape[-1] != index_page_bytes(page_size):
        raise ValueError(
            f"index_cache must be uint8 [num_pages, {index_page_bytes(page_size)}], got "
            f"{index_cache.dtype} {tuple(index_cache.shape)}"
        )
    if seq_lens.shape != (rows,) or page_table.ndim != 2 or page_table.shape[0] != rows:
        raise ValueError("seq_lens must be [R] and page_table [R, max_pages], one row per query")
    return weights


def index_topk(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    topk: int,
    page_size: int = INDEX_PAGE_SIZE,
    head_group: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: (pool slots `[R, topk]` int32, positions `[R, topk]` int32), `-1` past the valid
    count. `topk` must be a power of two >= 16."""
    weights = _check_inputs(q_fp8, weights, index_cache, seq_lens, page_table, page_size)
    if topk < 16 or topk & (topk - 1):
        raise ValueError(f"topk must be a power of two >= 16, got {topk}")
    rows, heads, _ = q_fp8.shape
    out = torch.empty(rows, topk, dtype=torch.int32, device=q_fp8.device)
    raw = torch.empty_like(out)
    if rows:
        _index_topk_kernel[(rows,)](
            q_fp8.contiguous().view(torch.uint8),
            weights,
            index_cache,
            index_cache.view(torch.float32),
            seq_lens.contiguous(),
            page_table,
            page_table.stride(0),
            out,
            raw,
            H=heads,
            HEAD_GROUP=head_group,
            TOPK=topk,
            PAGE=page_size,
            WRITE_RAW=True,
            num_warps=8,
        )
    return out, raw


def index_logits_reference(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int = INDEX_PAGE_SIZE,
) -> torch.Tensor:
    """Torch: float32 logits `[R, max(seq_lens)]`, `-inf` past each row's length."""
    weights = _check_inputs(q_fp8, weights, index_cache, seq_lens, page_table, page_size)
    rows = q_fp8.shape[0]
    width = int(seq_lens.max()) if rows else 0
    pos = torch.arange(width, device=q_fp8.device)
    valid = pos[None, :] < seq_lens[:, None]
    pages = page_table.long().gather(
        1, (pos // page_size).clamp(max=page_table.shape[1] - 1).expand(rows, -1)
    )
    slots = torch.where(valid, pages * page_size + pos % page_size, 0)
    codes, k_scale = read_index_rows(index_cache, slots.reshape(-1), page_size)
    k = e4m3_value_torch(codes).view(rows, width, INDEX_HEAD_DIM)
    dots = torch.einsum("rld,rhd->rlh", k, q_fp8.float())
    logits = (dots.clamp_min(0) * weights[:, None, :]).sum(-1) * k_scale.view(rows, width)
    return logits.masked_fill(~valid, float("-inf"))


def index_topk_reference(
    q_fp8: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    topk: int,
    page_size: int = INDEX_PAGE_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `index_topk` (selection among equal logits may differ)."""
    logits = index_logits_reference(q_fp8, weights, index_cache, seq_lens, page_table, page_size)
    rows = q_fp8.shape[0]
    raw = torch.full((rows, topk), -1, dtype=torch.int64, device=q_fp8.device)
    for r in range(rows):
        n = int(seq_lens[r])
        if n <= topk:
            raw[r, :n] = torch.arange(n)
        else:
            raw[r] = torch.topk(logits[r, :n], topk).indices
    valid = raw >= 0
    pages = page_table.long().gather(1, (raw.clamp_min(0) // page_size))
    slots = torch.where(valid, pages * page_size + raw.clamp_min(0) % page_size, -1)
    return slots.to(torch.int32), raw.to(torch.int32)


def _check_selection(scores, seq_lens, page_table, topk):
    if scores.ndim != 2:
        raise ValueError(f"scores must be [R, W], got {tuple(scores.shape)}")
    rows = scores.shape[0]
    if seq_lens.shape != (rows,) or page_table.ndim != 2 or page_table.shape[0] != rows:
        raise ValueError(
            "seq_lens must be [R] and page_table [R, max_pages], one row per score row"
        )
    if topk < 1:
        raise ValueError(f"topk must be positive, got {topk}")


def topk_transform(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    topk: int,
    page_size: int = INDEX_PAGE_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: `topk_transform_paged`'s selection over `scores` `[R, W]` (read as float32):
    (pool slots `[R, topk]` int32, positions `[R, topk]` int32), `-1` past the valid count; a
    selected row sorted by logit, then position, descending."""
    _check_selection(scores, seq_lens, page_table, topk)
    rows, width = scores.shape
    out = torch.empty(rows, topk, dtype=torch.int32, device=scores.device)
    raw = torch.empty_like(out)
    if rows:
        scores = scores if scores.stride(-1) == 1 else scores.contiguous()
        page_table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
        _topk_transform_kernel[(rows,)](
            scores,
            scores.stride(0),
            width,
            seq_lens.contiguous(),
            page_table,
            page_table.stride(0),
            out,
            raw,
            TOPK=topk,
            BLOCK=max(16, triton.next_power_of_2(topk)),
            PAGE=page_size,
        )
    return out, raw


def topk_transform_reference(
    scores: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    topk: int,
    page_size: int = INDEX_PAGE_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `topk_transform`, as SGLang's `topk_transform_pytorch_vectorized`
    computes it: rows with `seq_lens <= topk` whole and in order; the others by the same
    `torch.topk(..., sorted=False)` call on the same `-inf`-masked scores (so the same
    positions, ties and order as SGLang's torch path); a selected `-inf` is `-1`."""
    _check_selection(scores, seq_lens, page_table, topk)
    rows, width = scores.shape
    seq_lens = seq_lens.long()
    positions = torch.arange(width, device=scores.device)
    masked = scores.masked_fill(positions[None, :] >= seq_lens[:, None], float("-inf"))
    k = min(topk, width)
    raw = torch.topk(masked, k, dim=1, largest=True, sorted=False).indices
    valid = scores.gather(1, raw) != float("-inf")
    raw = torch.nn.functional.pad(raw, (0, topk - k), value=-1)
    valid = torch.nn.functional.pad(valid, (0, topk - k), value=False)
    whole = (seq_lens <= topk)[:, None]
    in_order = torch.arange(topk, device=scores.device).expand(rows, -1)
    raw = torch.where(whole, in_order, raw)
    valid = torch.where(whole, in_order < seq_lens[:, None], valid)
    raw = raw.masked_fill(~valid, -1)
    at = raw.clamp_min(0)
    pages = page_table.long().gather(1, at // page_size)
    slots = torch.where(valid, pages * page_size + at % page_size, -1)
    return slots.to(torch.int32), raw.to(torch.int32)
