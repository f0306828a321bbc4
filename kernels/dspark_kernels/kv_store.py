"""KV norm + RoPE + fp8 pack store: a 512-dim latent into V4's 584-byte FlashMLA cache row.

Shapes: `kv` `[n, 512]` bf16/fp16/fp32 (rows may be strided), `weight` `[512]`, `freqs_cis`
complex64 `[max_pos, 32]` (or its float32 `[max_pos, 64]` view), `positions` `[n]`, `out_loc`
`[n]` slot ids (a negative id skips the row), `cache` uint8 `[num_pages, v4_page_bytes(page_size)]`.

Per row: RMSNorm in float32 (`x * rsqrt(mean(x^2) + eps) * weight`), RoPE on dims 448..511
stored as bf16, and dims 0..447 as 7 tiles of 64 e4m3 codes with one UE8M0 scale each (the
power of two `>= max(amax, 1e-4) / 448`). Follows SGLang's `fused_k_norm_rope_flashmla`
(`FusedKNormRopeFlashMLAKernel`, `kernels/jit/csrc/deepseek_v4/main_norm_rope.cuh`, layout V4).
The compressor's store (`compress_norm_rope_store`, `fused_norm_rope_flashmla` in
`fused_norm_rope_v2.cuh`) is the same but rounds the normed nope values to bf16 before
quantizing; `round_nope_bf16=True` selects that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kv_layout import (
    HEAD_DIM,
    NOPE_DIM,
    NOPE_TILE,
    NOPE_TILES,
    PAGE_SIZE,
    v4_page_bytes,
    write_v4_rows,
)
from .numerics import (
    bf16_bits,
    e4m3_bits,
    e4m3_bits_torch,
    round_bf16,
    ue8m0_ceil,
    ue8m0_ceil_torch,
    ue8m0_inverse,
    ue8m0_value_torch,
)
from .rotation import rope_tail_torch


@triton.jit
def _norm_rope_v4_store_kernel(
    KV,
    kv_stride,
    W,
    FREQS,
    freqs_stride,
    POS,
    LOC,
    CACHE,
    CACHE16,
    eps,
    PAGE_SIZE: tl.constexpr,
    PAGE_BYTES: tl.constexpr,
    RATIO: tl.constexpr,
    ROUND_NOPE_BF16: tl.constexpr,
):
    """One program per row. RATIO 0: a plain KV row, roped at POS[row]. RATIO 4 / 128: row `t` is
    the compressor output of ragged token `t`, stored only where `(POS[t] + 1) % RATIO == 0`
    (padding tokens have POS -1) and roped at the group's first position."""
    row = tl.program_id(0)
    pos = tl.load(POS + row).to(tl.int64)
    if RATIO > 0:
        if pos < 0:
            return
        if (pos + 1) % RATIO != 0:
            return
        rope_pos = pos + 1 - RATIO
    else:
        rope_pos = pos
    loc = tl.load(LOC + row).to(tl.int64)
    if loc < 0:
        return

    d = tl.arange(0, 512)
    base = KV + row.to(tl.int64) * kv_stride
    x = tl.load(base + d).to(tl.float32)
    w = tl.load(W + d).to(tl.float32)
    inv_rms = tl.math.rsqrt(tl.sum(x * x, 0) / 512 + eps)
    y = x * inv_rms * w
    if ROUND_NOPE_BF16:
        y = round_bf16(y)

    tiles = tl.reshape(y, (8, 64))
    amax = tl.max(tl.abs(tiles), axis=1)
    exponent = ue8m0_ceil(tl.math.div_rn(tl.maximum(amax, 1e-4), 448.0))
    codes = e4m3_bits(tl.reshape(tiles * ue8m0_inverse(exponent)[:, None], (512,)))

    pair = tl.arange(0, 32)
    even = (
        tl.load(base + 448 + 2 * pair).to(tl.float32)
        * inv_rms
        * tl.load(W + 448 + 2 * pair).to(tl.float32)
    )
    odd = (
        tl.load(base + 449 + 2 * pair).to(tl.float32)
        * inv_rms
        * tl.load(W + 449 + 2 * pair).to(tl.float32)
    )
    cos = tl.load(FREQS + rope_pos * freqs_stride + 2 * pair)
    sin = tl.load(FREQS + rope_pos * freqs_stride + 2 * pair + 1)
    re = even * cos - odd * sin
    im = even * sin + odd * cos

    page = loc // PAGE_SIZE
    slot = loc % PAGE_SIZE
    data = page * PAGE_BYTES + slot * 576
    tl.store(CACHE + data + d, codes, mask=d < 448)
    rope16 = (data + 448) // 2
    tl.store(CACHE16 + rope16 + 2 * pair, bf16_bits(re))
    tl.store(CACHE16 + rope16 + 2 * pair + 1, bf16_bits(im))
    tile = tl.arange(0, 8)
    scale = page * PAGE_BYTES + PAGE_SIZE * 576 + slot * 8
    tl.store(CACHE + scale + tile, exponent.to(tl.uint8), mask=tile < 7)


def freqs_as_real(freqs_cis: torch.Tensor) -> torch.Tensor:
    """complex64 `[max_pos, 32]` -> float32 `[max_pos, 64]` (cos, sin interleaved); a float32
    `[max_pos, 64]` table passes through."""
    if freqs_cis.is_complex():
        freqs_cis = torch.view_as_real(freqs_cis).flatten(-2)
    if freqs_cis.dtype != torch.float32 or freqs_cis.ndim != 2 or freqs_cis.shape[1] != 64:
        raise ValueError(
            f"freqs_cis must be complex64 [max_pos, 32] or float32 [max_pos, 64], got "
            f"{freqs_cis.dtype} {tuple(freqs_cis.shape)}"
        )
    return freqs_cis.contiguous()


def check_v4_cache(cache: torch.Tensor, page_size: int) -> None:
    if cache.dtype != torch.uint8 or cache.ndim != 2 or not cache.is_contiguous():
        raise ValueError(f"cache must be contiguous uint8 [num_pages, bytes], got {cache.dtype}")
    if cache.shape[1] != v4_page_bytes(page_size):
        raise ValueError(
            f"cache pages are {cache.shape[1]} bytes; a V4 page of {page_size} tokens is "
            f"{v4_page_bytes(page_size)} (584 bytes a token, padded to 576)"
        )


def launch_v4_store(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cache: torch.Tensor,
    page_size: int,
    ratio: int,
    round_nope_bf16: bool,
) -> None:
    if kv.shape[0] == 0:
        return
    _norm_rope_v4_store_kernel[(kv.shape[0],)](
        kv,
        kv.stride(0),
        weight,
        freqs,
        freqs.stride(0),
        positions,
        out_loc,
        cache,
        cache.view(torch.int16),
        float(eps),
        PAGE_SIZE=page_size,
        PAGE_BYTES=cache.shape[1],
        RATIO=ratio,
        ROUND_NOPE_BF16=round_nope_bf16,
        num_warps=4,
    )


def kv_norm_rope_store(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cache: torch.Tensor,
    page_size: int = PAGE_SIZE,
    round_nope_bf16: bool = False,
) -> None:
    """Triton: normalize, rope and pack `kv` rows into V4 slots `out_loc` of `cache` (in place).

    Drop-in for SGLang's `fused_k_norm_rope_flashmla(kv, weight, eps, freqs_cis, positions,
    out_loc, cache, page_size)` with the V4 layout; `kv` is not modified.
    """
    if kv.ndim != 2 or kv.shape[1] != HEAD_DIM or kv.stride(1) != 1:
        raise ValueError(f"kv must be [n, 512] with unit stride, got {tuple(kv.shape)}")
    if positions.shape != (kv.shape[0],) or out_loc.shape != (kv.shape[0],):
        raise ValueError("positions and out_loc must be [n], one per kv row")
    check_v4_cache(cache, page_size)
    launch_v4_store(
        kv,
        weight.contiguous(),
        eps,
        freqs_as_real(freqs_cis),
        positions.contiguous(),
        out_loc.contiguous(),
        cache,
        page_size,
        ratio=0,
        round_nope_bf16=round_nope_bf16,
    )


def kv_norm_rope_store_reference(
    kv: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    freqs_cis: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cache: torch.Tensor,
    page_size: int = PAGE_SIZE,
    round_nope_bf16: bool = False,
) -> None:
    """Torch reference of `kv_norm_rope_store` (same arguments, writes `cache` in place)."""
    keep = out_loc >= 0
    x = kv[keep].float()
    if x.shape[0] == 0:
        return
    freqs = freqs_as_real(freqs_cis).view(-1, 32, 2)[positions[keep].long()]
    y = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / HEAD_DIM + eps) * weight.float()
    rope = rope_tail_torch(y, freqs)[:, NOPE_DIM:]
    nope = y[:, :NOPE_DIM]
    if round_nope_bf16:
        nope = nope.to(torch.bfloat16).float()
    tiles = nope.view(-1, NOPE_TILES, NOPE_TILE)
    exponent = ue8m0_ceil_torch(tiles.abs().amax(-1).clamp_min(1e-4) / 448.0)
    codes = e4m3_bits_torch(tiles * ue8m0_value_torch(254 - exponent)[..., None])
    write_v4_rows(cache, out_loc[keep], codes.view(-1, NOPE_DIM), exponent, rope, page_size)
