"""Indexer query preparation: RoPE + 128-point Hadamard + fp8 quantization, and the indexer K store.

Query (`indexer_query`): `q` `[n, H, 128]` bf16 (the `wq_b` output of the C4 indexer), `weight`
`[n, H]` (the `weights_proj` output), `weight_scale` (`head_dim^-0.5 * H^-0.5`), `freqs_cis`
complex64 `[max_pos, 32]`, `positions` `[n]`. Per head: rope the trailing 64 dims, rotate by
`H_128 / sqrt(128)`, quantize to e4m3 with one float32 scale `max(amax, 1e-4) / 448`. Returns
`q_fp8` `[n, H, 128]` float8_e4m3fn and `weights` `[n, H, 1]` float32 =
`weight * weight_scale * scale`. Follows SGLang's `fused_q_indexer_rope_hadamard_quant`
(`FusedQIndexerRopeHadamardQuantKernel` in `kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh`,
V4: rope on the trailing dims, Hadamard on).

Key (`index_k_store`): the C4 indexer compressor's store, `fused_norm_rope_indexer` in
`fused_norm_rope_v2.cuh`: RMSNorm with a weight, then the same rope + Hadamard + fp8, written as
128 e4m3 codes + one float32 scale into the 132-byte rows of the 64-token indexer pages.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_layout import INDEX_HEAD_DIM, INDEX_PAGE_SIZE, index_page_bytes, write_index_rows
from .kv_store import freqs_as_real
from .numerics import e4m3_bits, e4m3_bits_torch
from .rotation import hadamard_128, hadamard_torch, rope_tail_torch


@triton.jit
def _rope_pairs(even, odd, FREQS, freqs_stride, pos, pair):
    """Rotate pairs 32..63 (dims 64..127) of `[rows, 64]` even/odd tensors at `pos`."""
    is_rope = pair >= 32
    cos = tl.load(FREQS + pos * freqs_stride + 2 * (pair - 32), mask=is_rope, other=1.0)
    sin = tl.load(FREQS + pos * freqs_stride + 2 * (pair - 32) + 1, mask=is_rope, other=0.0)
    re = even * cos - odd * sin
    im = even * sin + odd * cos
    return tl.where(is_rope, re, even), tl.where(is_rope, im, odd)


@triton.jit
def _indexer_query_kernel(
    Q,
    q_stride,
    WEIGHT,
    weight_stride,
    weight_scale,
    FREQS,
    freqs_stride,
    POS,
    Q_OUT,
    W_OUT,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pair = tl.arange(0, 64)
    valid = head < H
    pos = tl.load(POS + token).to(tl.int64)

    src = Q + token * q_stride + head[:, None] * 128 + 2 * pair[None, :]
    even = tl.load(src, mask=valid[:, None], other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=valid[:, None], other=0.0).to(tl.float32)
    even, odd = _rope_pairs(even, odd, FREQS, freqs_stride, pos, pair[None, :])
    even, odd = hadamard_128(even, odd, BLOCK_H)

    amax = tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    inv_scale = tl.math.div_rn(tl.full([BLOCK_H], 1.0, tl.float32), scale)
    dst = Q_OUT + (token * H + head[:, None]) * 128 + 2 * pair[None, :]
    tl.store(dst, e4m3_bits(even * inv_scale[:, None]), mask=valid[:, None])
    tl.store(dst + 1, e4m3_bits(odd * inv_scale[:, None]), mask=valid[:, None])

    w = tl.load(WEIGHT + token * weight_stride + head, mask=valid, other=0.0).to(tl.float32)
    tl.store(W_OUT + token * H + head, w * weight_scale * scale, mask=valid)


def indexer_query(
    q: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: float,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
    block_h: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: (q_fp8 `[n, H, 128]` float8_e4m3fn, weights `[n, H, 1]` float32).

    Drop-in for SGLang's `fused_q_indexer_rope_hadamard_quant(q, weight, weight_scale,
    freqs_cis, positions)`.
    """
    if q.ndim != 3 or q.shape[2] != INDEX_HEAD_DIM or q.stride(2) != 1 or q.stride(1) != 128:
        raise ValueError(f"q must be [n, H, 128] with contiguous heads, got {tuple(q.shape)}")
    n, heads, _ = q.shape
    if weight.shape != (n, heads) or weight.stride(1) != 1:
        raise ValueError(f"weight must be [{n}, {heads}] with unit head stride")
    q_codes = torch.empty(n, heads, INDEX_HEAD_DIM, dtype=torch.uint8, device=q.device)
    weights = torch.empty(n, heads, 1, dtype=torch.float32, device=q.device)
    if n:
        freqs = freqs_as_real(freqs_cis)
        grid = (n, triton.cdiv(heads, block_h))
        _indexer_query_kernel[grid](
            q,
            q.stride(0),
            weight,
            weight.stride(0),
            float(weight_scale),
            freqs,
            freqs.stride(0),
            positions.contiguous(),
            q_codes,
            weights,
            H=heads,
            BLOCK_H=block_h,
            num_warps=4,
        )
    return q_codes.view(torch.float8_e4m3fn), weights


def _rope_hadamard_quant_torch(x: torch.Tensor, freqs: torch.Tensor):
    """float32 `[..., 128]` -> (codes uint8, scales float32 `[...]`)."""
    rotated = hadamard_torch(rope_tail_torch(x, freqs))
    scale = rotated.abs().amax(-1).clamp_min(1e-4) / 448.0
    return e4m3_bits_torch(rotated * (1.0 / scale)[..., None]), scale


def indexer_query_reference(
    q: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: float,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `indexer_query`."""
    freqs = freqs_as_real(freqs_cis).view(-1, 32, 2)[positions.long()][:, None]
    codes, scale = _rope_hadamard_quant_torch(q.float(), freqs)
    weights = weight.float() * torch.tensor(weight_scale, dtype=torch.float32) * scale
    return codes.view(torch.float8_e4m3fn), weights[..., None]


@triton.jit
def _index_k_store_kernel(
    K,
    k_stride,
    W,
    eps,
    FREQS,
    freqs_stride,
    POS,
    LOC,
    CACHE,
    CACHE32,
    PAGE_SIZE: tl.constexpr,
    RATIO: tl.constexpr,
):
    """One program per ragged token; row `t` of K is the compressor output of token `t`, stored
    where `(POS[t] + 1) % RATIO == 0`, roped at the group's first position."""
    row = tl.program_id(0)
    pos = tl.load(POS + row).to(tl.int64)
    if pos < 0:
        return
    if (pos + 1) % RATIO != 0:
        return
    loc = tl.load(LOC + row).to(tl.int64)
    if loc < 0:
        return
    pair = tl.arange(0, 64)[None, :]
    src = K + row.to(tl.int64) * k_stride + 2 * pair
    even = tl.load(src).to(tl.float32)
    odd = tl.load(src + 1).to(tl.float32)
    inv_rms = tl.math.rsqrt((tl.sum(even * even, 1) + tl.sum(odd * odd, 1)) / 128 + eps)[:, None]
    even = even * inv_rms * tl.load(W + 2 * pair).to(tl.float32)
    odd = odd * inv_rms * tl.load(W + 2 * pair + 1).to(tl.float32)
    even, odd = _rope_pairs(even, odd, FREQS, freqs_stride, pos + 1 - RATIO, pair)
    even, odd = hadamard_128(even, odd, 1)

    amax = tl.max(tl.maximum(tl.abs(even), tl.abs(odd)), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0)
    inv_scale = tl.math.div_rn(tl.full([1], 1.0, tl.float32), scale)[:, None]
    page = loc // PAGE_SIZE
    slot = loc % PAGE_SIZE
    data = CACHE + page * (PAGE_SIZE * 132) + slot * 128 + 2 * pair
    tl.store(data, e4m3_bits(even * inv_scale))
    tl.store(data + 1, e4m3_bits(odd * inv_scale))
    one = tl.arange(0, 1)
    tl.store(CACHE32 + (page * (PAGE_SIZE * 132) + PAGE_SIZE * 128) // 4 + slot + one, scale)


def index_k_store(
    k: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cache: torch.Tensor,
    ratio: int = 4,
    page_size: int = INDEX_PAGE_SIZE,
) -> None:
    """Triton: norm + rope + Hadamard + fp8 store of compressor rows `k` `[T, 128]` (row `t` =
    ragged token `t`, kept where `(positions[t] + 1) % ratio == 0`) into indexer slots
    `out_loc[t]` of `cache` uint8 `[num_pages, page_size * 132]`."""
    if k.ndim != 2 or k.shape[1] != INDEX_HEAD_DIM or k.stride(1) != 1:
        raise ValueError(f"k must be [T, 128] with unit stride, got {tuple(k.shape)}")
    if cache.dtype != torch.uint8 or cache.shape[-1] != index_page_bytes(page_size):
        raise ValueError(
            f"index cache must be uint8 [num_pages, {index_page_bytes(page_size)}] "
            f"(132 bytes a token, {page_size} tokens a page), got {cache.dtype} "
            f"{tuple(cache.shape)}"
        )
    if k.shape[0] == 0:
        return
    freqs = freqs_as_real(freqs_cis)
    _index_k_store_kernel[(k.shape[0],)](
        k,
        k.stride(0),
        weight,
        float(eps),
        freqs,
        freqs.stride(0),
        positions,
        out_loc,
        cache,
        cache.view(torch.float32),
        PAGE_SIZE=page_size,
        RATIO=ratio,
        num_warps=1,
    )


def index_k_store_reference(
    k: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    rope_positions: torch.Tensor,
    out_loc: torch.Tensor,
    cache: torch.Tensor,
    page_size: int = INDEX_PAGE_SIZE,
) -> None:
    """Torch reference of the indexer K store for rows `k` `[n, 128]` roped at
    `rope_positions` `[n]`, written to `out_loc` `[n]` (all rows kept)."""
    x = k.float()
    y = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / INDEX_HEAD_DIM + eps) * weight.float()
    freqs = freqs_as_real(freqs_cis).view(-1, 32, 2)[rope_positions.long()]
    codes, scale = _rope_hadamard_quant_torch(y, freqs)
    write_index_rows(cache, out_loc, codes, scale, page_size)
