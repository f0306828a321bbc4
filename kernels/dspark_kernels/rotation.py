"""RoPE on interleaved pairs and the 128-point Hadamard rotation, as Triton helpers and torch twins.

V4 ropes the trailing 64 dims of a head as 32 interleaved (real, imag) pairs: dims `2i, 2i + 1` of
the tail rotate by `freqs_cis[position, i]` (complex64 `[max_pos, 32]`, read as float32
`[max_pos, 64]` = cos, sin interleaved). The indexer then applies the Sylvester Hadamard matrix
`H_128 / sqrt(128)` (`H[i, j] = (-1)^popcount(i & j)`), which SGLang's CUDA kernels compute as a
butterfly over the index bits in ascending order, low half `a + b`, high half `a - b`
(`fused_q_indexer_rope_hadamard_quant` in `main_norm_rope.cuh`). The Triton helper does the same
additions in the same order, so it matches the CUDA kernel bit for bit.

Triton kernels hold a 128-dim head as two `[rows, 64]` tensors, the even and the odd dims, so a
RoPE pair is one element of each and the first butterfly stage is `(even + odd, even - odd)`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

HADAMARD_SCALE = 1.0 / math.sqrt(128.0)


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, N: tl.constexpr, STRIDE: tl.constexpr):
    """One butterfly stage on the last axis of `[ROWS, N]`: pairs `(i, i + STRIDE)` inside blocks
    of `2 * STRIDE` become `(lo + hi, lo - hi)`."""
    x4 = tl.reshape(x, (ROWS, N // (2 * STRIDE), 2, STRIDE))
    half = tl.arange(0, 2)[None, None, :, None]
    total = tl.sum(x4, axis=2)
    diff = tl.sum(tl.where(half == 0, x4, -x4), axis=2)
    out = tl.where(half == 1, diff[:, :, None, :], total[:, :, None, :])
    return tl.reshape(out, (ROWS, N))


@triton.jit
def hadamard_128(even, odd, ROWS: tl.constexpr):
    """`H_128 / sqrt(128)` applied to heads given as even / odd dims `[ROWS, 64]` each; returns the
    even and odd dims of the result."""
    e = even + odd
    o = even - odd
    for b in tl.static_range(6):
        e = _butterfly(e, ROWS, 64, 1 << b)
        o = _butterfly(o, ROWS, 64, 1 << b)
    return e * 0.08838834764831845, o * 0.08838834764831845


def rope_tail_torch(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 64 dims of float32 `x` `[..., D]` by float32 `freqs` `[..., 32, 2]`
    (cos, sin per pair, broadcast over `x`'s middle dims), interleaved pairs."""
    out = x.clone()
    tail = x[..., -64:].unflatten(-1, (32, 2))
    re, im = tail[..., 0], tail[..., 1]
    cos, sin = freqs[..., 0], freqs[..., 1]
    out[..., -64:] = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
    return out


def hadamard_torch(x: torch.Tensor) -> torch.Tensor:
    """Fast Walsh-Hadamard transform of the last axis (power of two), scaled by `1/sqrt(n)`:
    `x @ H_n / sqrt(n)` with the butterflies in ascending bit order."""
    n = x.shape[-1]
    y = x.float().clone()
    stride = 1
    while stride < n:
        blocks = y.unflatten(-1, (n // (2 * stride), 2, stride))
        lo, hi = blocks[..., 0, :], blocks[..., 1, :]
        y = torch.stack([lo + hi, lo - hi], dim=-2).flatten(-3)
        stride *= 2
    return y * torch.tensor(1.0 / math.sqrt(n), dtype=torch.float32)


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The unscaled Sylvester Hadamard matrix `H_n` (float32), for checking `hadamard_torch`."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h
