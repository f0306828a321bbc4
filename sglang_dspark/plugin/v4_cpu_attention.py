"""`v4_cpu_sparse_attention`: DeepSeek-V4's sparse MQA attention in torch on CPU.

V4's `dsv4` backend attends with FlashMLA's sparse fp8 kernel: each query row reads its
sliding-window slots of the SWA cache (`swa_page_indices`) and, on C4 / C128 layers, its
compressed slots of the layer's extra cache, both in the 584-byte V4 row layout, with an
attention sink per head (`DeepseekV4AttnBackend._forward_attention`,
`layers/attention/deepseek_v4_backend.py:4380`). On CPU there is no FlashMLA:
- every metadata build calls `get_mla_metadata` (`_create_flashmla_metadata`,
  `deepseek_v4_backend.py:210`), and importing `flash_mla` loads `flash_mla/cuda.abi3.so`,
  which fails without a CUDA driver;
- the backend binds `self._flash_mla_with_kvcache` only `if is_cuda()`
  (`deepseek_v4_backend.py:1262`), so the attention call is an AttributeError.

On CPU the hook gives the metadata no FlashMLA schedule (None, as SGLang does on SM120 and
XPU) and binds, on a CPU backend, a torch version of that kernel following SGLang's own torch
reference `_sm120_sparse_decode_fwd` (`kernels/ops/attention/flash_mla_sm120.py:136`) and
reusing its row reader `_gather_and_dequant`: dequantize the selected rows (e4m3 x UE8M0 tile
scale for dims 0..447, bf16 rope dims; exact in bf16), one float32 softmax over SWA and extra
slots with the sink in the denominator, output in the query's dtype (FlashMLA's bf16 for a bf16
model; a float32 model keeps float32), 32 query rows at a time.
Prefill takes the same kernel with `SGLANG_OPT_FLASHMLA_SPARSE_PREFILL=0` (set by the
`v4_cpu_defaults` hook), as it does for prompts up to 11673 tokens on a GPU with that off.
"""

from __future__ import annotations

import torch

from sglang_dspark.plugin.registry import register_after, register_around

BACKEND = "sglang.srt.layers.attention.deepseek_v4_backend"


QUERY_CHUNK = 32  # query rows per gather: bounds the float32 working set of long prefills


def _slots(k_cache, indices, topk_length):
    """Dequantized rows `[B, 1, K, 512]` and the invalid mask `[B, 1, K]` of one cache.

    Only the valid slots are read; an invalid one is 0 (the attention zeroes it anyway). Early
    in a sequence most of the `K` slots (window 128, compressed top-512) are invalid: reading
    slot 0 for each, as a gather of the clamped indices would, was half of a sampled DSPARK
    run's time on the tiny V4."""
    from sglang.kernels.ops.attention.flash_mla_sm120 import _D, _gather_and_dequant

    invalid = indices < 0
    if topk_length is not None:
        k = torch.arange(indices.shape[-1]).view(1, 1, -1)
        invalid = invalid | (k >= topk_length.view(-1, 1, 1))
    kv = torch.zeros(*indices.shape, _D, dtype=torch.bfloat16, device=indices.device)
    valid = ~invalid
    if valid.any():
        kv[valid] = _gather_and_dequant(k_cache, indices[valid], k_cache.shape[1])
    return kv, invalid


def sparse_attention_torch(
    q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
    extra_k_cache=None, extra_indices=None, extra_topk_length=None,
):  # fmt: skip
    """FlashMLA's sparse fp8 decode on CPU: `q` `[B, 1, H, 512]`, `indices` `[B, 1, K]` slots of
    `k_cache` (`[pages, page_size, 1, 584]` V4 rows), optional extra cache; returns
    (`[B, 1, H, head_dim_v]` in `q`'s dtype, lse `[B, H, 1]`). Follows SGLang's torch reference
    `_sm120_sparse_decode_fwd` (float32 softmax, sink in the denominator, an all-masked row
    gives 0) without its final bf16 cast, so a float32 model keeps float32."""
    heads = q.shape[2]
    if attn_sink is not None and attn_sink.numel() < heads:
        # the DSpark draft pads its query to 64 heads (FlashMLA's width) and keeps one sink
        # per real head; the padding heads are sliced away by the caller: left at 0 here
        real = attn_sink.numel()
        out, lse = sparse_attention_torch(
            q[:, :, :real], k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
            extra_k_cache, extra_indices, extra_topk_length,
        )  # fmt: skip
        padded = out.new_zeros(*out.shape[:2], heads, out.shape[-1])
        padded[:, :, :real] = out
        return padded, torch.cat([lse, lse.new_zeros(lse.shape[0], heads - real, 1)], dim=1)
    outs, lses = [], []
    for start in range(0, q.shape[0], QUERY_CHUNK):
        rows = slice(start, start + QUERY_CHUNK)
        kv, invalid = _slots(
            k_cache, indices[rows], None if topk_length is None else topk_length[rows]
        )
        if extra_k_cache is not None and extra_indices is not None:
            extra_len = None if extra_topk_length is None else extra_topk_length[rows]
            extra_kv, extra_invalid = _slots(extra_k_cache, extra_indices[rows], extra_len)
            kv = torch.cat([kv, extra_kv], dim=2)
            invalid = torch.cat([invalid, extra_invalid], dim=2)
        kv = kv.float().masked_fill(invalid[..., None], 0.0)
        qf = q[rows].float()[..., : kv.shape[-1]]
        scores = torch.einsum("bshd,bstd->bsht", qf, kv) * softmax_scale
        scores.masked_fill_(invalid.unsqueeze(2), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [b, 1, H]
        denom = lse
        if attn_sink is not None:
            sink = attn_sink.float().view(1, 1, -1).expand_as(lse)
            denom = torch.logaddexp(lse, sink)
        lonely = lse == float("-inf")
        denom = denom.masked_fill(lonely, float("inf"))
        out = torch.einsum("bsht,bstv->bshv", torch.exp(scores - denom[..., None]),
                           kv[..., :head_dim_v])  # fmt: skip
        outs.append(out.masked_fill(lonely[..., None], 0.0).to(q.dtype))
        lses.append(lse.permute(0, 2, 1))
    return torch.cat(outs), torch.cat(lses)


def flash_mla_with_kvcache_torch(
    q, k_cache, block_table=None, cache_seqlens=None, head_dim_v=512,
    tile_scheduler_metadata=None, num_splits=None, softmax_scale=None, causal=False,
    descale_q=None, descale_k=None, is_fp8_kvcache=True, indices=None, attn_sink=None,
    extra_k_cache=None, extra_indices_in_kvcache=None, topk_length=None,
    extra_topk_length=None, kv_format=None, **_,
):  # fmt: skip
    """`flash_mla_with_kvcache` for V4's sparse fp8 call, on CPU tensors: (out, lse)."""
    if indices is None or not is_fp8_kvcache or block_table is not None:
        raise NotImplementedError(
            "the CPU FlashMLA stand-in implements V4's sparse fp8 attention only "
            "(indices given, is_fp8_kvcache=True, no block table)"
        )
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    return sparse_attention_torch(
        q, k_cache, indices, topk_length, attn_sink, head_dim_v, softmax_scale,
        extra_k_cache, extra_indices_in_kvcache, extra_topk_length,
    )  # fmt: skip


def _no_flashmla_schedule_on_cpu(original):
    from sglang.srt.utils import is_cpu

    return None if is_cpu() else original()


def _bind_torch_flashmla(_result, backend, *args, **kwargs) -> None:
    if backend.device.type != "cpu":
        return
    backend._swa_interleaved = backend.token_to_kv_pool.get_swa_key_layout().is_interleaved
    backend._flash_mla_with_kvcache = flash_mla_with_kvcache_torch
    backend._flashmla_split_kv_min_topk = 1 << 30  # V4.1's split-KV pre-scheduling: never


def install() -> None:
    register_around(f"{BACKEND}._create_flashmla_metadata", _no_flashmla_schedule_on_cpu)
    register_after(f"{BACKEND}.DeepseekV4AttnBackend.__init__", _bind_torch_flashmla)


HOOKS = {"v4_cpu_sparse_attention": install}
