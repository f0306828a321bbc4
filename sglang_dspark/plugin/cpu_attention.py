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

    kv_index: torch.Tensor  # [bs, l] token-pool slots: context, then the window's own slots
    q_index: torch.Tensor  # [bs, w] rows of q (padding rows repeat row 0)
    mask: torch.Tensor  # [bs, 1, w, l] True = attend
    out_rows: torch.Tensor  # [num valid] rows of the padded [bs * w] output, in q order


def _plan(backend, forward_batch, lens: list[int], causal: bool, device) -> _VerifyPlan:
    seq_lens = forward_batch.seq_lens.tolist()
    pools = forward_batch.req_pool_indices.tolist()
    out_loc = forward_batch.out_cache_loc
    key = (tuple(seq_lens), tuple(pools), tuple(lens), causal, tuple(out_loc[: sum(lens)].tolist()))
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
    out_rows, start = [], 0
    for i, (s, n) in enumerate(zip(seq_lens, lens)):
        kv_index[i, :s] = req_to_token[pools[i], :s]
        kv_index[i, s : s + n] = out_loc[start : start + n]
        q_index[i, :n] = torch.arange(start, start + n, device=device)
        mask[i, 0, :n, :s] = True
        window = torch.ones(n, n, dtype=torch.bool, device=device)
        mask[i, 0, :n, s : s + n] = window.tril() if causal else window
        mask[i, 0, n:, 0] = True  # padding rows attend to one key (no all-masked softmax)
        out_rows += range(i * w, i * w + n)
        start += n
    cached[key] = _VerifyPlan(kv_index, q_index, mask, torch.tensor(out_rows, device=device))
    return cached[key]


def target_verify_attention(backend, q, k, v, layer, forward_batch, save_kv_cache=True):
    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    num_tokens = q.shape[0]
    q_ = q.view(num_tokens, layer.tp_q_head_num, layer.qk_head_dim)
    if not save_kv_cache:
        return _target_verify_unsaved(backend, q, k, v, layer, forward_batch)
    backend.token_to_kv_pool.set_kv_buffer(
        layer, KVWriteLoc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v
    )
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    lens = _window_lens(forward_batch, num_tokens)
    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    plan = _plan(backend, forward_batch, lens, causal, q.device)
    bs, l = plan.kv_index.shape
    flat = plan.kv_index.view(-1)
    keys = k_cache.index_select(0, flat).view(bs, l, layer.tp_k_head_num, -1).to(q.dtype)
    values = v_cache.index_select(0, flat).view(bs, l, layer.tp_v_head_num, -1).to(q.dtype)
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
    valid = plan.out_rows.numel()
    out = q.new_zeros(num_tokens, layer.tp_q_head_num, layer.v_head_dim)
    out[:valid] = rows.index_select(0, plan.out_rows)
    return out.view(num_tokens, layer.tp_q_head_num * layer.v_head_dim)


def _target_verify_unsaved(backend, q, k, v, layer, forward_batch):
    """Per-request path for a pass that does not write its keys to the pool."""
    from sglang.srt.layers.radix_attention import AttentionType

    num_tokens = q.shape[0]
    q_ = q.view(num_tokens, layer.tp_q_head_num, layer.qk_head_dim)
    k_ = k.view(num_tokens, layer.tp_k_head_num, layer.qk_head_dim)
    v_ = v.view(num_tokens, layer.tp_v_head_num, layer.v_head_dim)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    req_to_token = backend.req_to_token_pool.req_to_token
    causal = layer.attn_type != AttentionType.ENCODER_ONLY
    out = q.new_zeros(num_tokens, layer.tp_q_head_num, layer.v_head_dim)
    seq_lens = forward_batch.seq_lens.tolist()
    pools = forward_batch.req_pool_indices.tolist()
    start = 0
    for i, n in enumerate(_window_lens(forward_batch, num_tokens)):
        ctx = req_to_token[pools[i], : seq_lens[i]].long()
        keys = torch.cat([k_cache[ctx].to(q.dtype), k_[start : start + n]], 0)
        values = torch.cat([v_cache[ctx].to(q.dtype), v_[start : start + n]], 0)
        mask = None
        if causal:
            # row r sees all context and window rows 0..r
            mask = torch.ones(n, seq_lens[i] + n, dtype=torch.bool, device=q.device)
            mask[:, seq_lens[i] :] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        o = scaled_dot_product_attention(
            q_[start : start + n].transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            scale=layer.scaling,
            enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
        )
        out[start : start + n] = o.squeeze(0).transpose(0, 1)
        start += n
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
