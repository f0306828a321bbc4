"""Byte layouts of V4's paged caches, and torch readers/writers for them.

FlashMLA main KV, `KVLayout.V4` in SGLang (`kernels/ops/attention/dsv4/kv_layout.py`,
`sgl_kernel/deepseek_v4/kv_layout.cuh`): 584 bytes a token. A page holds `page_size` data rows of
576 bytes (448 e4m3 "nope" values, then 64 bf16 RoPE values) followed by `page_size` scale rows of
8 bytes (7 UE8M0 exponents, one per 64 nope values, and a pad byte), padded to a multiple of 576:
a 256-token page is 149760 bytes. Token `loc` lives in page `loc // page_size`, slot
`loc % page_size`.

Indexer K (C4 indexer, `fused_norm_rope_indexer` in `fused_norm_rope_v2.cuh`): 132 bytes a token,
a 64-token page is 64 rows of 128 e4m3 values followed by 64 float32 scales (8448 bytes).
"""

from __future__ import annotations

import torch

from .numerics import e4m3_value_torch, ue8m0_value_torch

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
NOPE_TILE = 64
NOPE_TILES = NOPE_DIM // NOPE_TILE  # 7
V4_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
V4_SCALE_BYTES = 8
V4_TOKEN_BYTES = V4_DATA_BYTES + V4_SCALE_BYTES  # 584
PAGE_SIZE = 256

INDEX_HEAD_DIM = 128
INDEX_PAGE_SIZE = 64
INDEX_TOKEN_BYTES = INDEX_HEAD_DIM + 4  # 132


def v4_page_bytes(page_size: int = PAGE_SIZE) -> int:
    """Bytes of one V4 page: `page_size * 584` rounded up to a multiple of 576."""
    return -(-page_size * V4_TOKEN_BYTES // V4_DATA_BYTES) * V4_DATA_BYTES


def index_page_bytes(page_size: int = INDEX_PAGE_SIZE) -> int:
    return page_size * INDEX_TOKEN_BYTES


def new_v4_cache(num_pages: int, page_size: int = PAGE_SIZE, device="cpu") -> torch.Tensor:
    """A zeroed V4 FlashMLA cache, uint8 `[num_pages, v4_page_bytes(page_size)]`."""
    return torch.zeros(num_pages, v4_page_bytes(page_size), dtype=torch.uint8, device=device)


def new_index_cache(num_pages: int, page_size: int = INDEX_PAGE_SIZE, device="cpu") -> torch.Tensor:
    """A zeroed indexer K cache, uint8 `[num_pages, page_size * 132]`."""
    return torch.zeros(num_pages, index_page_bytes(page_size), dtype=torch.uint8, device=device)


def _v4_offsets(loc: torch.Tensor, page_size: int, page_bytes: int):
    loc = loc.to(torch.int64)
    page, slot = loc // page_size, loc % page_size
    data = page * page_bytes + slot * V4_DATA_BYTES
    scale = page * page_bytes + page_size * V4_DATA_BYTES + slot * V4_SCALE_BYTES
    return data, scale


def write_v4_rows(
    cache: torch.Tensor,
    loc: torch.Tensor,
    nope_codes: torch.Tensor,
    scale_exponents: torch.Tensor,
    rope_bf16: torch.Tensor,
    page_size: int = PAGE_SIZE,
) -> None:
    """Write `[n, 448]` e4m3 codes, `[n, 7]` UE8M0 exponents and `[n, 64]` bf16 RoPE values to
    V4 slots `loc` (`[n]`, distinct, >= 0) of `cache` in place."""
    flat = cache.view(torch.uint8).view(-1)
    data, scale = _v4_offsets(loc, page_size, cache.shape[-1])
    arange = lambda n: torch.arange(n, device=cache.device)
    flat[(data[:, None] + arange(NOPE_DIM)).view(-1)] = nope_codes.reshape(-1).to(torch.uint8)
    rope_bytes = rope_bf16.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(len(loc), -1)
    flat[(data[:, None] + NOPE_DIM + arange(2 * ROPE_DIM)).view(-1)] = rope_bytes.reshape(-1)
    flat[(scale[:, None] + arange(NOPE_TILES)).view(-1)] = scale_exponents.reshape(-1).to(
        torch.uint8
    )


def read_v4_rows(cache: torch.Tensor, loc: torch.Tensor, page_size: int = PAGE_SIZE):
    """The raw parts of V4 slots `loc`: e4m3 codes `[n, 448]` uint8, UE8M0 exponents `[n, 7]`
    uint8 and RoPE values `[n, 64]` bf16."""
    flat = cache.view(torch.uint8).view(-1)
    data, scale = _v4_offsets(loc, page_size, cache.shape[-1])
    arange = lambda n: torch.arange(n, device=cache.device)
    codes = flat[data[:, None] + arange(NOPE_DIM)]
    rope = flat[data[:, None] + NOPE_DIM + arange(2 * ROPE_DIM)].contiguous().view(torch.bfloat16)
    exponents = flat[scale[:, None] + arange(NOPE_TILES)]
    return codes, exponents, rope


def dequantize_v4_rows(cache: torch.Tensor, loc: torch.Tensor, page_size: int = PAGE_SIZE):
    """V4 slots `loc` as float32 `[n, 512]`, following SGLang's `dequantize_k_cache_paged_ref`."""
    codes, exponents, rope = read_v4_rows(cache, loc, page_size)
    scale = ue8m0_value_torch(exponents.to(torch.int32)).repeat_interleave(NOPE_TILE, dim=1)
    return torch.cat([e4m3_value_torch(codes) * scale, rope.float()], dim=1)


def _index_offsets(loc: torch.Tensor, page_size: int):
    loc = loc.to(torch.int64)
    page, slot = loc // page_size, loc % page_size
    base = page * index_page_bytes(page_size)
    return base + slot * INDEX_HEAD_DIM, base + page_size * INDEX_HEAD_DIM + slot * 4


def write_index_rows(
    cache: torch.Tensor,
    loc: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    page_size: int = INDEX_PAGE_SIZE,
) -> None:
    """Write `[n, 128]` e4m3 codes and `[n]` float32 scales to indexer slots `loc` in place."""
    flat = cache.view(torch.uint8).view(-1)
    data, scale = _index_offsets(loc, page_size)
    arange = lambda n: torch.arange(n, device=cache.device)
    flat[(data[:, None] + arange(INDEX_HEAD_DIM)).view(-1)] = codes.reshape(-1).to(torch.uint8)
    scale_bytes = scales.float().contiguous().view(torch.uint8).reshape(-1)
    flat[(scale[:, None] + arange(4)).view(-1)] = scale_bytes


def read_index_rows(cache: torch.Tensor, loc: torch.Tensor, page_size: int = INDEX_PAGE_SIZE):
    """Indexer slots `loc`: e4m3 codes `[n, 128]` uint8 and float32 scales `[n]`."""
    flat = cache.view(torch.uint8).view(-1)
    data, scale = _index_offsets(loc, page_size)
    arange = lambda n: torch.arange(n, device=cache.device)
    codes = flat[data[:, None] + arange(INDEX_HEAD_DIM)]
    scales = flat[scale[:, None] + arange(4)].contiguous().view(torch.float32).view(-1)
    return codes, scales
