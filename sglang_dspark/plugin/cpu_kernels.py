"""Torch implementations of the sgl-kernel CPU ops that SGLang's CPU path calls.

On a CPU machine SGLang expects sgl-kernel's CPU build (`*_cpu` ops). The PyPI wheel of
sgl-kernel is CUDA-only, so those imports fail; patch 0001 turns the failure into a named
placeholder and these hooks replace the placeholders with torch code of the same signature.
All ops are small bookkeeping copies between index tensors and the KV pool.

Hook names (for SGLANG_DSPARK_DISABLE_HOOKS): `cpu_sgl_kernel_ops`.
"""

from __future__ import annotations

import ctypes

import torch

from sglang_dspark.plugin.registry import register_replace


def _segments(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row id and column of every (row i, column in [start_i, end_i)) pair, in row order."""
    lens = (end - start).long().clamp_min(0)
    rows = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens
    cols = start.long()[rows] + torch.arange(int(lens.sum()), device=lens.device) - first[rows]
    return rows, cols


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """req_to_token[req_i, start_i:end_i] = the next (end_i - start_i) entries of out_cache_loc."""
    rows, cols = _segments(start_offset, end_offset)
    req_to_token[req_pool_indices.long()[rows], cols] = out_cache_loc[: rows.numel()].to(
        req_to_token.dtype
    )


def assign_extend_cache_locs_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """The reverse gather: out_cache_loc (packed) = req_to_token[req_i, start_i:end_i]."""
    rows, cols = _segments(start_offset, end_offset)
    out_cache_loc[: rows.numel()] = req_to_token[req_pool_indices.long()[rows], cols].to(
        out_cache_loc.dtype
    )


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_cols
):
    """out_cache_loc[i, :] = req_to_token[req_i, seq_len_i : seq_len_i + topk * num_cols]."""
    width = topk * num_cols
    cols = seq_lens.long()[:, None] + torch.arange(width, device=seq_lens.device)
    vals = req_to_token[req_pool_indices.long()[:, None], cols]
    out_cache_loc[: vals.numel()] = vals.reshape(-1).to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_i = the last accepted token of request i (accept_lens include the bonus)."""
    idx = torch.arange(accept_lens.numel()) * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Pack the KV slots of the accepted positions (accept_index != -1) to the front."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1].long()
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer (raw base pointer, row stride in bytes): row[tgt] = row[src].

    The pool hands us raw pointers, so each buffer is viewed as uint8 rows without a copy.
    Source rows are gathered before any write, so overlapping moves are safe.
    """
    if tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.long()
    src = src_loc.long()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        view = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        view[tgt] = view[src]


_OPS = {
    "sglang.srt.mem_cache.allocation.assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "sglang.kernels.ops.speculative.cache_locs.assign_extend_cache_locs_cpu": (
        assign_extend_cache_locs_cpu
    ),
    "sglang.kernels.ops.speculative.cache_locs.assign_draft_cache_locs_contiguous_cpu": (
        assign_draft_cache_locs_contiguous_cpu
    ),
    "sglang.kernels.ops.speculative.eagle.fill_bonus_tokens_cpu": fill_bonus_tokens_cpu,
    "sglang.kernels.ops.speculative.eagle.fill_accept_out_cache_loc_cpu": (
        fill_accept_out_cache_loc_cpu
    ),
    "sglang.kernels.ops.kvcache.cache_move.copy_all_layer_kv_cache_cpu": (
        copy_all_layer_kv_cache_cpu
    ),
}


def install_cpu_sgl_kernel_ops() -> None:
    from sglang.srt.utils import is_cpu

    if not is_cpu():
        return
    for target, impl in _OPS.items():
        register_replace(target, impl)


HOOKS = {"cpu_sgl_kernel_ops": install_cpu_sgl_kernel_ops}
