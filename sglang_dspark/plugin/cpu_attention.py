"""`torch_native_target_verify`: the TARGET_VERIFY attention path for the torch_native backend.

Upstream's torch_native backend handles prefill/extend and decode only. Speculative decoding runs
two passes in TARGET_VERIFY mode and both reach `forward_extend` without extend lengths:
- the target verifies each request's window [anchor, draft_1..] causally over its context;
- the DSPARK draft runs the block [anchor, mask x (gamma-1)] with bidirectional attention inside
  the block (its layers are ENCODER_ONLY) over the injected context KV.
Per request, keys are the cached context (req_to_token[:seq_len]) followed by the window's own
keys; the window is causal for decoder layers and full for encoder-only layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang_dspark.plugin.registry import register_around


def _window_lens(forward_batch, num_tokens: int) -> list[int]:
    """Tokens per request in this verify pass: the ragged layout's verify lengths under
    `compact` verify (the scheduler trims each request's window), else uniform."""
    bs = int(forward_batch.batch_size)
    layout = getattr(getattr(forward_batch, "spec_info", None), "ragged_verify_layout", None)
    if layout is not None:
        lens = layout.verify_lens_cpu
        if lens is None:
            lens = layout.verify_lens.tolist()
        lens = [int(x) for x in lens][:bs]
        if sum(lens) <= num_tokens:  # rows past the last window are graph-tier padding
            return lens
    lens = getattr(forward_batch, "extend_seq_lens_cpu", None)
    if lens is not None and len(lens) == bs and sum(int(x) for x in lens) == num_tokens:
        return [int(x) for x in lens]
    if num_tokens % bs:
        raise RuntimeError(
            f"TARGET_VERIFY on torch_native got {num_tokens} tokens for {bs} requests"
        )
    return [num_tokens // bs] * bs


@dataclass(frozen=True)
class _VerifyPlan:
    """Index and mask tensors of one verify pass, shared by all of its layers.

    Requests are padded to the longest window (`w`) and the longest key list (`l`) so that a
    layer is one gather and one SDPA call, whatever the batch size.
    """

    kv_index: torch.Tensor  # [bs, l] token-pool slots of each request's context (0 elsewhere)
    window_rows: torch.Tensor  # [num valid] rows of the padded [bs * l] keys holding the window
    q_index: torch.Tensor  # [bs, w] rows of q (padding rows repeat row 0)
    mask: torch.Tensor  # [bs, 1, w, l] True = attend
    out_rows: torch.Tensor  # [num valid] rows of the padded [bs * w] output, in q order


def _plan(backend, forward_batch, lens: list[int], causal: bool, device) -> _VerifyPlan:
    seq_lens = forward_batch.seq_lens.tolist()
    pools = forward_batch.req_pool_indices.tolist()
    key = (tuple(seq_lens), tuple(pools), tuple(lens), causal)
    cached = getattr(forward_batch, "_dspark_verify_plans", None)
    if cached is None:
        cached = {}
        forward_batch._dspark_verify_plans = cached  # a new ForwardBatch per forward pass
    if key in cached:
        return cached[key]
    bs, w = len(lens), max(lens)
    l = max(s + n for s, n in zip(seq_lens, lens))
    req_to_token = backend.req_to_token_pool.req_to_token
    kv_index = torch.zeros(bs, l, dtype=torch.long, device=device)
    q_index = torch.zeros(bs, w, dtype=torch.long, device=device)
    mask = torch.zeros(bs, 1, w, l, dtype=torch.bool, device=device)
    window_rows, out_rows, start = [], [], 0
    for i, (s, n) in enumerate(zip(seq_lens, lens)):
        kv_index[i, :s] = req_to_token[pools[i], :s]
        window_rows += range(i * l + s, i * l + s + n)
        q_index[i, :n] = torch.arange(start, start + n, device=device)
        mask[i, 0, :n, :s] = True
        window = torch.ones(n, n, dtype=torch.bool, device=device)
        mask[i, 0, :n, s : s + n] = window.tril() if causal else window
        mask[i, 0, n:, 0] = True  # padding rows attend to one key (no all-masked softmax)
        out_rows += range(i * w, i * w + n)
        start += n
    cached[key] = _VerifyPlan(
        kv_index, torch.tensor(window_rows, device=device), q_index, mask,
        torch.tensor(out_rows, device=device),
    )  # fmt: skip
    return cached[key]


def _gather(cache, own, plan: _VerifyPlan, dtype):
    """[bs, l, heads, dim] keys or values: each request's cached context, then its window's own (taken
    from this pass, so a caller that writes the pool itself, save_kv_cache=False, reads the
    same)."""
    bs, l = plan.kv_index.shape
    keys = cache.index_select(0, plan.kv_index.view(-1)).to(dtype)
    keys.index_copy_(0, plan.window_rows, own[: plan.window_rows.numel()].to(dtype))
    return keys.view(bs, l, *keys.shape[1:])


def target_verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache=True):
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    if save_kv_cache:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v
        )
    num_tokens = q.shape[0]
    q_ = q.view(num_tokens, layer.tp_q_head_num, layer.qk_head_dim)
    k_ = k.view(num_tokens, layer.tp_k_head_num, layer.qk_head_dim)
    v_ = v.view(num_tokens, layer.tp_v_head_num, layer.v_head_dim)
    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    plan = _plan(backend, forward_batch, _window_lens(forward_batch, num_tokens), causal, q.device)
    bs = plan.kv_index.shape[0]
    keys = _gather(backend.token_to_kv_pool.get_key_buffer(layer.layer_id), k_, plan, q.dtype)
    values = _gather(backend.token_to_kv_pool.get_value_buffer(layer.layer_id), v_, plan, q.dtype)
    queries = q_.index_select(0, plan.q_index.view(-1)).view(bs, -1, *q_.shape[1:])
    o = scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=plan.mask,
        scale=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
    )  # [bs, heads, w, v_dim]
    rows = o.transpose(1, 2).reshape(-1, layer.tp_q_head_num, layer.v_head_dim)
    out = q.new_zeros(num_tokens, layer.tp_q_head_num, layer.v_head_dim)
    out[: plan.out_rows.numel()] = rows.index_select(0, plan.out_rows)
    return out.view(num_tokens, layer.tp_q_head_num * layer.v_head_dim)


def _forward_extend(original, backend, q, k, v, layer, forward_batch, save_kv_cache=True):
    if forward_batch.forward_mode.is_target_verify() and not layer.is_cross_attention:
        return target_verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache)
    return original(backend, q, k, v, layer, forward_batch, save_kv_cache)


def install_target_verify() -> None:
    register_around(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        _forward_extend,
    )


HOOKS = {"torch_native_target_verify": install_target_verify}
