"""The C4 / C128 compressor for ragged verify: plan, compression from the per-request state, store.

V4 layers with compress ratio 4 or 128 keep, besides their sliding-window KV, one compressed KV
row per `ratio` tokens. Each token's `wkv_gate` output `kv_score` `[T, coff * 2 * D]`
(float32 from `linear_bf16_fp32`; `coff = 2` for C4, whose groups overlap, else 1) is laid out
`| kv overlap | kv | score overlap | score |` (C4) or `| kv | score |` (C128). When a token closes a
group (`(position + 1) % ratio == 0`) the compressor takes the window of the last
`W = 8` (C4: previous group's overlap half + this group) or `W = 128` tokens, softmaxes
`score + ape` over the window per dim and sums `kv` with those weights; the row is then
RMS-normed, roped at the group's first position and stored: into the V4 FlashMLA cache
(`D = 512`, nope rounded to bf16 then fp8, see `kv_store`) or, for the C4 indexer (`D = 128`),
Hadamard-rotated into the indexer K cache (see `indexer_query.index_k_store`).

Window tokens before the verify block come from the state ring (`state` `[rows, coff * 2 * D]`,
float32 or bf16), those inside it from `kv_score`; afterwards the tokens the next steps will
need are written to the ring. Follows SGLang's `compress_forward` + `compress_norm_rope_store`
(`kernels/ops/attention/dsv4/compress.py`) with `CompressorPrefillPlan(extend_lens=verify_lens)`:
`flash_c4_prefill` / `write_c4_prefill` (`kernels/jit/csrc/deepseek_v4/c4_v2.cuh`),
`flash_c128_prefill` / `write_c128_prefill` (`c128_v2.cuh`), plans from `c_plan.cuh`, stores
from `fused_norm_rope_v2.cuh`. Mixed dtypes round as the CUDA code does: state values are cast
to the input dtype before use, the output has the input dtype.

The Triton path needs no compact plan: three launches over the ragged tokens (compress, store,
state write; the write comes last because compressions read the pre-write ring). A token's
window entry `i` (source position `p = position - (W - 1) + i`) comes from the ring exactly when
`p < prefix_len`, which is SGLang's `i < buffer_len`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .indexer_query import index_k_store, index_k_store_reference
from .kv_layout import HEAD_DIM, INDEX_HEAD_DIM
from .kv_store import check_v4_cache, freqs_as_real, kv_norm_rope_store_reference, launch_v4_store
from .numerics import bf16_bits, round_bf16
from .ragged_plan import RaggedVerifyPlan, StateAddressing, compress_plans_reference, write_pad

_NEG_FLT_MAX = -3.4028234663852886e38


@triton.jit
def _state_loc(pos, rid, R2T, r2t_stride, F2S, swa_page_size, ring_size, REQ_RING: tl.constexpr):
    if REQ_RING:
        loc = rid * ring_size + pos % ring_size
    else:
        full = tl.load(R2T + rid * r2t_stride + pos).to(tl.int64)
        swa = tl.load(F2S + full).to(tl.int64)
        loc = (swa // swa_page_size) * ring_size + swa % ring_size
    return loc


@triton.jit
def _compress_kernel(
    X,
    x_stride,
    STATE,
    state_stride,
    APE,
    OUT,
    TOKEN_REQ,
    TOKEN_POS,
    PREFIX,
    REQ_POOL,
    R2T,
    r2t_stride,
    F2S,
    swa_page_size,
    ring_size,
    D: tl.constexpr,
    RATIO: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_D: tl.constexpr,
    REQ_RING: tl.constexpr,
    ROUND_STATE: tl.constexpr,
    ROUND_OUT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    pos = tl.load(TOKEN_POS + t).to(tl.int64)
    if pos < 0:
        return
    if (pos + 1) % RATIO != 0:
        return
    b = tl.load(TOKEN_REQ + t)
    prefix = tl.load(PREFIX + b).to(tl.int64)
    rid = tl.load(REQ_POOL + b).to(tl.int64)

    i = tl.arange(0, WINDOW)
    src = pos - (WINDOW - 1) + i
    from_state = src < prefix
    page = _state_loc(pos, rid, R2T, r2t_stride, F2S, swa_page_size, ring_size, REQ_RING) // RATIO
    if RATIO == 4:
        prev = tl.maximum(pos - 4, 0)
        page0 = _state_loc(prev, rid, R2T, r2t_stride, F2S, swa_page_size, ring_size, REQ_RING) // 4
        page = tl.where(i < 4, page0, page)
        kv_col = tl.where(i < 4, 0, D)
        score_col = tl.where(i < 4, 2 * D, 3 * D)
    else:
        kv_col = i * 0
        score_col = i * 0 + D
    state_row = page * RATIO + (src % RATIO)
    input_row = t - (WINDOW - 1) + i

    m_state = from_state[:, None]
    m_input = ~m_state
    s_base = STATE + state_row[:, None] * state_stride + col[None, :]
    x_base = X + input_row[:, None] * x_stride + col[None, :]
    s_kv = tl.load(s_base + kv_col[:, None], mask=m_state, other=0.0).to(tl.float32)
    s_score = tl.load(s_base + score_col[:, None], mask=m_state, other=0.0).to(tl.float32)
    if ROUND_STATE:
        s_kv = round_bf16(s_kv)
        s_score = round_bf16(s_score)
    x_kv = tl.load(x_base + kv_col[:, None], mask=m_input, other=0.0).to(tl.float32)
    x_score = tl.load(x_base + score_col[:, None], mask=m_input, other=0.0).to(tl.float32)
    kv = tl.where(m_state, s_kv, x_kv)
    score = tl.where(m_state, s_score, x_score)
    if RATIO == 4:
        no_overlap = (i[:, None] < 4) & (pos < 4)
        kv = tl.where(no_overlap, 0.0, kv)
        score = tl.where(no_overlap, -3.4028234663852886e38, score)
    score = score + tl.load(APE + i[:, None] * D + col[None, :]).to(tl.float32)

    peak = tl.max(score, axis=0)
    weight = tl.exp(score - peak[None, :])
    out = tl.sum(kv * weight, axis=0) / tl.sum(weight, axis=0)
    if ROUND_OUT:
        out = round_bf16(out)
    tl.store(OUT + t * D + col, out)


@triton.jit
def _state_write_kernel(
    X,
    x_stride,
    STATE,
    STATE16,
    state_stride,
    TOKEN_REQ,
    TOKEN_POS,
    PREFIX,
    VERIFY,
    REQ_POOL,
    R2T,
    r2t_stride,
    F2S,
    swa_page_size,
    ring_size,
    write_pad,
    ROW: tl.constexpr,
    RATIO: tl.constexpr,
    OVERLAP: tl.constexpr,
    REQ_RING: tl.constexpr,
    PAGE_TAIL: tl.constexpr,
    STATE_BF16: tl.constexpr,
):
    """OVERLAP: 4 for C4 (the previous group stays resident), else 0. PAGE_TAIL: also keep the
    last 4 tokens of every SWA page (paged C4 state), which the next page's first window reads."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(TOKEN_POS + t).to(tl.int64)
    if pos < 0:
        return
    b = tl.load(TOKEN_REQ + t)
    seq_len = (tl.load(PREFIX + b) + tl.load(VERIFY + b)).to(tl.int64)
    first = tl.minimum(seq_len // RATIO * RATIO - OVERLAP, seq_len - write_pad)
    write = pos >= first
    if PAGE_TAIL:
        write = write | (pos % swa_page_size >= swa_page_size - 4)
    if write:
        rid = tl.load(REQ_POOL + b).to(tl.int64)
        slot = _state_loc(pos, rid, R2T, r2t_stride, F2S, swa_page_size, ring_size, REQ_RING)
        c = tl.arange(0, ROW)
        v = tl.load(X + t * x_stride + c).to(tl.float32)
        if STATE_BF16:
            tl.store(STATE16 + slot * state_stride + c, bf16_bits(v))
        else:
            tl.store(STATE + slot * state_stride + c, v)


def _check(kv_score, state, ape, ratio, head_dim):
    if ratio not in (4, 128):
        raise ValueError(f"compress ratio must be 4 or 128, got {ratio}")
    if head_dim not in (HEAD_DIM, INDEX_HEAD_DIM) or (head_dim == INDEX_HEAD_DIM and ratio != 4):
        raise ValueError(f"head_dim {head_dim}: 512 (C4/C128 KV) or 128 (the C4 indexer)")
    row = (4 if ratio == 4 else 2) * head_dim
    if kv_score.ndim != 2 or kv_score.shape[1] != row or kv_score.stride(1) != 1:
        raise ValueError(f"kv_score must be [T, {row}], got {tuple(kv_score.shape)}")
    if state.ndim != 2 or state.shape[1] != row or not state.is_contiguous():
        raise ValueError(f"state must be contiguous [rows, {row}], got {tuple(state.shape)}")
    if state.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"state must be float32 or bfloat16, got {state.dtype}")
    window = 8 if ratio == 4 else 128
    if ape.shape != (window, head_dim):
        raise ValueError(
            f"ape must be [{window}, {head_dim}] (SGLang's hotfixed layout, `ape.view(-1, D)`), "
            f"got {tuple(ape.shape)}"
        )


def _addressing(addr: StateAddressing) -> tuple:
    return (
        addr.req_pool_indices,
        addr.req_to_token,
        addr.req_to_token.stride(0),
        addr.full_to_swa,
        addr.swa_page_size,
        addr.ring_size,
    )


def compress_pool(
    kv_score: torch.Tensor,
    state: torch.Tensor,
    ape: torch.Tensor,
    plan: RaggedVerifyPlan,
    addr: StateAddressing,
    ratio: int,
) -> torch.Tensor:
    """Triton, step (1) of `compress_verify`: the pooled rows `[T, D]` float32 (rounded to
    bf16 for a bf16 `kv_score`), meaningful where a token closes a group. Reads the state ring,
    writes nothing."""
    head_dim = ape.shape[-1]
    _check(kv_score, state, ape, ratio, head_dim)
    tokens = kv_score.shape[0]
    if tokens != plan.num_tokens:
        raise ValueError(f"kv_score must have one row per plan token ({plan.num_tokens})")
    input_bf16 = kv_score.dtype == torch.bfloat16
    ape = ape.to(kv_score.dtype).contiguous()
    out = torch.empty(tokens, head_dim, dtype=torch.float32, device=kv_score.device)
    if tokens == 0:
        return out
    block_d = 128 if ratio == 4 else 64
    _compress_kernel[(tokens, head_dim // block_d)](
        kv_score,
        kv_score.stride(0),
        state,
        state.stride(0),
        ape,
        out,
        plan.token_req,
        plan.token_pos,
        plan.prefix_lens,
        *_addressing(addr),
        D=head_dim,
        RATIO=ratio,
        WINDOW=8 if ratio == 4 else 128,
        BLOCK_D=block_d,
        REQ_RING=ratio == 128 or addr.use_req_ring,
        ROUND_STATE=input_bf16 and state.dtype == torch.float32,
        ROUND_OUT=input_bf16,
        num_warps=4,
    )
    return out


def compress_state_write(
    kv_score: torch.Tensor,
    state: torch.Tensor,
    plan: RaggedVerifyPlan,
    addr: StateAddressing,
    ratio: int,
) -> None:
    """Triton, step (3) of `compress_verify`: write the tokens later steps need to the state
    ring (SGLang's write plan). Run it after `compress_pool`, which reads the pre-write ring."""
    if kv_score.shape[0] == 0:
        return
    req_ring = ratio == 128 or addr.use_req_ring
    _state_write_kernel[(kv_score.shape[0],)](
        kv_score,
        kv_score.stride(0),
        state,
        state.view(torch.int16) if state.dtype == torch.bfloat16 else state,
        state.stride(0),
        plan.token_req,
        plan.token_pos,
        plan.prefix_lens,
        plan.verify_lens,
        *_addressing(addr),
        write_pad(ratio, addr.ring_size),
        ROW=kv_score.shape[1],
        RATIO=ratio,
        OVERLAP=4 if ratio == 4 else 0,
        REQ_RING=req_ring,
        PAGE_TAIL=ratio == 4 and not req_ring,
        STATE_BF16=state.dtype == torch.bfloat16,
        num_warps=4,
    )


def compress_verify(
    kv_score: torch.Tensor,
    state: torch.Tensor,
    ape: torch.Tensor,
    plan: RaggedVerifyPlan,
    addr: StateAddressing,
    ratio: int,
    norm_weight: torch.Tensor,
    norm_eps: float,
    freqs_cis: torch.Tensor,
    out_loc: torch.Tensor,
    cache: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    """Triton: compress, store and update the state for one layer of a ragged verify batch.

    `kv_score` `[T, coff * 2 * D]` (row `t` = plan token `t`), `state` the layer's state ring
    (updated in place), `ape` `[W, D]`, `out_loc` `[T]` compressed-cache slots
    (`plan.c4_out_loc` / `plan.c128_out_loc`), `cache` the compressed cache (V4 pages of
    `page_size` tokens for `D = 512`, indexer pages for `D = 128`; written in place). Returns the
    compressed rows `[T, D]` float32, meaningful where a token closes a group.
    """
    if out_loc.shape != (kv_score.shape[0],):
        raise ValueError(f"out_loc must have one row per plan token ({plan.num_tokens})")
    out = compress_pool(kv_score, state, ape, plan, addr, ratio)
    if out.shape[0] == 0:
        return out
    weight = norm_weight.to(kv_score.dtype).contiguous()
    freqs = freqs_as_real(freqs_cis)
    if out.shape[1] == HEAD_DIM:
        check_v4_cache(cache, page_size)
        launch_v4_store(
            out, weight, norm_eps, freqs, plan.token_pos, out_loc, cache, page_size, ratio, True
        )
    else:
        index_k_store(
            out, weight, norm_eps, freqs, plan.token_pos, out_loc, cache, ratio, page_size
        )
    compress_state_write(kv_score, state, plan, addr, ratio)
    return out


def compress_verify_reference(
    kv_score: torch.Tensor,
    state: torch.Tensor,
    ape: torch.Tensor,
    verify_lens: list[int],
    prefix_lens: list[int],
    addr: StateAddressing,
    ratio: int,
    norm_weight: torch.Tensor,
    norm_eps: float,
    freqs_cis: torch.Tensor,
    out_loc: torch.Tensor,
    cache: torch.Tensor,
    page_size: int,
) -> dict[int, torch.Tensor]:
    """Torch reference of `compress_verify`, driven by SGLang's compact plans
    (`compress_plans_reference`). Updates `state` and `cache` in place; returns
    `{ragged token id: compressed row [D] float32}`."""
    head_dim = ape.shape[-1]
    _check(kv_score, state, ape, ratio, head_dim)
    window = 8 if ratio == 4 else 128
    in_dtype = kv_score.dtype
    cast_in = lambda v: v.to(in_dtype).float()
    x = kv_score.float()
    ape = cast_in(ape)
    plan_c, plan_w = compress_plans_reference(verify_lens, prefix_lens, ratio, addr)
    d = head_dim

    rows = {}
    for seq_len, t, buffer_len, page0, page1 in plan_c.tolist():
        kv = torch.empty(window, d)
        score = torch.empty(window, d)
        for i in range(window):
            overlap = ratio == 4 and i < 4
            kv_col = 0 if (ratio == 128 or overlap) else d
            score_col = (d if ratio == 128 else 2 * d) + kv_col
            if overlap and seq_len <= 4:
                kv[i], score[i] = 0.0, _NEG_FLT_MAX
                continue
            if i < buffer_len:
                slot = (page0 * 4 + i) if overlap else (page1 * ratio + i % ratio)
                src = cast_in(state[slot])
            else:
                src = x[t - (window - 1) + i]
            kv[i], score[i] = src[kv_col : kv_col + d], src[score_col : score_col + d]
        weight = torch.softmax(score + ape, dim=0)
        rows[t] = cast_in((kv * weight).sum(0))

    if rows:
        ids = torch.tensor(list(rows))
        compressed = torch.stack(list(rows.values())).to(in_dtype)
        seq = plan_c[:, 0]
        weight = norm_weight.to(in_dtype)
        if head_dim == HEAD_DIM:
            kv_norm_rope_store_reference(
                compressed, weight, norm_eps, freqs_cis, seq - ratio, out_loc[ids], cache,
                page_size, round_nope_bf16=True,
            )  # fmt: skip
        else:
            index_k_store_reference(
                compressed, weight, norm_eps, freqs_cis, seq - ratio, out_loc[ids], cache, page_size
            )
    for t, slot in plan_w.tolist():
        state[slot] = kv_score[t].to(state.dtype)
    return rows
