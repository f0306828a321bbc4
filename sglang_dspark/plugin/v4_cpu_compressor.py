"""`v4_cpu_compressor`: DeepSeek-V4's C4 / C128 KV compressor in torch on CPU.

Every C4 / C128 layer (and the C4 indexer) turns each group of `ratio` tokens into one
compressed KV row: `wkv_gate` gives each token `kv | score` (C4: also the overlap half), and a
token closing a group pools the window of its last 8 (C4, overlapping) or 128 tokens with
`softmax(score + ape)`; the row is RMS-normed, roped at the group's first position and stored
in the layer's compressed cache (V4 584-byte rows; the indexer's 132-byte rows, Hadamard-
rotated). Window tokens of earlier forwards come from a per-request state ring. In SGLang
0.5.23 all three steps are CUDA-only (JIT, `kernels/ops/attention/dsv4/compress.py`):
- the plans (`CompressorPrefillPlan.generate` / `CompressorDecodePlan.generate`, from
  `create_paged_compressor_data`, `layers/attention/dsv4/compressor_v2.py:423`) allocate a
  pinned buffer (`compress.py:269`: "Found no NVIDIA driver") and call `c_plan.cuh`;
- `compress_forward` (`c4_v2.cuh`, `c128_v2.cuh`) and `compress_norm_rope_store`
  (`fused_norm_rope_v2.cuh`) are JIT CUDA modules.

On CPU tensors the hook builds SGLang's own compact prefill plan (`CompressPlan {seq_len,
ragged_id, buffer_len, read_page_0, read_page_1}`, `WritePlan {ragged_id, write_loc}`, the same
bytes as `plan_compress_prefill`) with `dspark_kernels.ragged_plan.compress_plans_reference`;
a decode step is planned as an extend of one token per request (the same compressions and
state rows). `compress_forward` then pools each plan row in torch (window entry `i < buffer_len`
from the state ring, else from this forward's tokens; the C4 overlap half is empty for the
first group) and writes the plan's state rows after all compressions, as the CUDA kernels do;
`compress_norm_rope_store` stores with `kv_norm_rope_store_reference(round_nope_bf16=True)` /
`index_k_store_reference` (`dspark_kernels`, byte-exact against the CUDA stores on the kernel
tests). Only V4's layout: no fp4 indexer, bf16 store, two-pool fp8 or online C128.

With `SGLANG_DSPARK_V4_KERNELS=triton` (see `v4_kernels`) the plan also carries the per-token
ragged plan (`dspark_kernels.ragged_plan.ragged_verify_plan`) and the state addressing, and
`compress_forward` pools and writes the state ring with `dspark_kernels.compressor`'s Triton
kernels (`compress_pool`, `compress_state_write`; the compact plan still orders the output
rows), the store with `kv_norm_rope_store` / `index_k_store`.
"""

from __future__ import annotations

import functools

import torch

from sglang_dspark.plugin import v4_kernels
from sglang_dspark.plugin.registry import register_around

COMPRESS = "sglang.kernels.ops.attention.dsv4.compress"
PLANNER = "sglang.srt.layers.attention.dsv4.compressor_v2.create_paged_compressor_data"
_NEG_FLT_MAX = -3.4028234663852886e38


def _window(ratio: int) -> int:
    return 8 if ratio == 4 else 128


@functools.cache
def _ragged_plan_class():
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    class RaggedCompressorPlan(CompressorPrefillPlan):
        """SGLang's compact prefill plan, plus what the Triton compressor reads: `tokens`
        (`RaggedVerifyPlan`) and `addr` (`StateAddressing`)."""

    return RaggedCompressorPlan


def plan_on_cpu(
    compress_ratio: int,
    *,
    is_prefill: bool,
    token_to_kv_pool,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_lens: torch.Tensor | None = None,
    seq_lens_cpu=None,
    extend_lens_cpu=None,
    kernels: str | None = None,
):
    """SGLang's `CompressorPrefillPlan` for this batch, built on the host; for the Triton
    compressor (`kernels`, default `SGLANG_DSPARK_V4_KERNELS`) with its ragged plan."""
    from dspark_kernels.ragged_plan import (
        StateAddressing,
        compress_plans_reference,
        pack_compress_plans,
    )
    from sglang.kernels.ops.attention.dsv4.compress import CompressorPrefillPlan

    seq = [int(x) for x in (seq_lens_cpu if seq_lens_cpu is not None else seq_lens.tolist())]
    if is_prefill:
        ext = extend_lens_cpu if extend_lens_cpu is not None else extend_lens.tolist()
        ext = [int(x) for x in ext]
    else:
        ext = [1] * len(seq)
    addr = StateAddressing(
        req_pool_indices=req_pool_indices.to(torch.int64),
        req_to_token=req_to_token,
        full_to_swa=token_to_kv_pool.full_to_swa_index_mapping.detach(),
        swa_page_size=token_to_kv_pool.swa_page_size,
        ring_size=token_to_kv_pool.get_ring_size(compress_ratio=compress_ratio),
        use_req_ring=compress_ratio == 4 and token_to_kv_pool._unified_kv,
    )
    prefix = [s - e for s, e in zip(seq, ext)]
    plan_c, plan_w = compress_plans_reference(ext, prefix, compress_ratio, addr)
    plan_c, plan_w = pack_compress_plans(plan_c, plan_w)
    if (kernels or v4_kernels.v4_kernels()) != v4_kernels.TRITON or not seq:
        return CompressorPrefillPlan(compress_ratio, plan_c, plan_w)
    from dspark_kernels.ragged_plan import ragged_verify_plan

    plan = _ragged_plan_class()(compress_ratio, plan_c, plan_w)
    plan.tokens = ragged_verify_plan(
        torch.tensor(ext, dtype=torch.int32, device=seq_lens.device),
        torch.tensor(prefix, dtype=torch.int32, device=seq_lens.device),
        sum(ext),
    )
    plan.addr = addr
    return plan


def unpack_plan_c(plan_c: torch.Tensor) -> torch.Tensor:
    """uint8 `[n, 16]` CompressPlans -> int64 `[n, 5]` (seq_len, ragged_id, buffer_len,
    read_page_0, read_page_1)."""
    words = plan_c.contiguous().view(torch.int32).to(torch.int64)
    return torch.stack(
        [words[:, 0], words[:, 1] & 0xFFFF, (words[:, 1] >> 16) & 0xFFFF, words[:, 2], words[:, 3]],
        dim=1,
    )


def unpack_plan_w(plan_w: torch.Tensor) -> torch.Tensor:
    """uint8 `[n, 8]` WritePlans -> int64 `[n, 2]` (ragged_id, write_loc)."""
    return plan_w.contiguous().view(torch.int32).to(torch.int64)


def compress_forward_torch(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan,
    *,
    head_dim: int,
    compress_ratio: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`compress_forward` for a prefill plan: `[num_c, head_dim]` compressed rows in the input
    dtype; the plan's state rows are written to `kv_score_buffer` afterwards."""
    ratio, d, window = compress_ratio, head_dim, _window(compress_ratio)
    state = kv_score_buffer.view(-1, kv_score_buffer.shape[-1])
    in_dtype = kv_score_input.dtype
    x = kv_score_input.float()
    ape = ape.to(in_dtype).float()
    rows = unpack_plan_c(plan[1])
    if out is None:
        out = kv_score_input.new_empty((rows.shape[0], d))
    if rows.shape[0]:
        seq_len, t, buffer_len, page0, page1 = rows.unbind(1)
        i = torch.arange(window)
        overlap = (i < 4) if ratio == 4 else torch.zeros(window, dtype=torch.bool)
        kv_col = torch.where(overlap, 0, d if ratio == 4 else 0)  # [W]
        score_col = (d if ratio == 128 else 2 * d) + kv_col
        from_state = i[None, :] < buffer_len[:, None]  # [n, W]
        slot = torch.where(
            overlap[None, :], page0[:, None] * 4 + i, page1[:, None] * ratio + i % ratio
        )
        src_row = (t[:, None] - (window - 1) + i).clamp(min=0)
        state_rows = state[slot.clamp(min=0).view(-1)].to(in_dtype).float().view(*slot.shape, -1)
        input_rows = x[src_row.view(-1)].view(*src_row.shape, -1)
        src = torch.where(from_state[..., None], state_rows, input_rows)  # [n, W, row]
        cols = torch.arange(d)
        kv = src.gather(2, (kv_col[:, None] + cols).expand(src.shape[0], -1, -1))
        score = src.gather(2, (score_col[:, None] + cols).expand(src.shape[0], -1, -1))
        empty = overlap[None, :] & (seq_len[:, None] <= 4)  # the first C4 group has no overlap
        kv = kv.masked_fill(empty[..., None], 0.0)
        score = score.masked_fill(empty[..., None], _NEG_FLT_MAX)
        weight = torch.softmax(score + ape[None], dim=1)
        out.copy_((kv * weight).sum(1).to(in_dtype))
    writes = unpack_plan_w(plan[2])
    if writes.shape[0]:
        state[writes[:, 1]] = kv_score_input[writes[:, 0]].to(state.dtype)
    return out


def compress_forward_triton(
    kv_score_buffer: torch.Tensor,
    kv_score_input: torch.Tensor,
    ape: torch.Tensor,
    plan,
    *,
    head_dim: int,
    compress_ratio: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`compress_forward_torch` by `dspark_kernels.compressor`'s Triton kernels, for a plan
    from `plan_on_cpu(kernels="triton")`: every token's pooled row, those of the compact plan
    (its order) returned, then the state write."""
    from dspark_kernels.compressor import compress_pool, compress_state_write

    if not hasattr(plan, "tokens"):
        raise RuntimeError(
            f"{v4_kernels.ENV}=triton: this compressor plan has no ragged plan; it was built "
            "before the switch was read (set the variable before the server starts)"
        )
    if kv_score_input.device.type == "cpu":
        v4_kernels.require_interpreter()
    state = kv_score_buffer.view(-1, kv_score_buffer.shape[-1])
    ape = ape.reshape(-1, head_dim)
    rows = unpack_plan_c(plan[1])
    if out is None:
        out = kv_score_input.new_empty((rows.shape[0], head_dim))
    pooled = compress_pool(kv_score_input, state, ape, plan.tokens, plan.addr, compress_ratio)
    out.copy_(pooled[rows[:, 1]].to(kv_score_input.dtype))
    compress_state_write(kv_score_input, state, plan.tokens, plan.addr, compress_ratio)
    return out


def compress_norm_rope_store_torch(
    kv: torch.Tensor, plan, *, norm_weight, norm_eps, freq_cis, out_loc, kvcache, page_size,
    kernels: str | None = None,
) -> None:  # fmt: skip
    """`compress_norm_rope_store` for a prefill plan, V4 layout (512) or indexer K (128), by
    `dspark_kernels`' references or (`kernels`, default `SGLANG_DSPARK_V4_KERNELS`) its Triton
    stores."""
    from dspark_kernels.indexer_query import index_k_store_reference
    from dspark_kernels.kv_store import kv_norm_rope_store_reference

    rows = unpack_plan_c(plan[1])
    if rows.shape[0] == 0:
        return
    positions = rows[:, 0] - plan.compress_ratio
    loc = out_loc[rows[:, 1]]
    weight = norm_weight.to(kv.dtype)
    if kv.shape[-1] not in (512, 128):
        raise NotImplementedError(f"no CPU compressor store for head_dim {kv.shape[-1]}")
    if (kernels or v4_kernels.v4_kernels()) == v4_kernels.TRITON:
        from dspark_kernels.indexer_query import index_k_store
        from dspark_kernels.kv_store import kv_norm_rope_store

        if kv.device.type == "cpu":
            v4_kernels.require_interpreter()
        kv, loc, seq_len = kv.contiguous(), loc.contiguous(), rows[:, 0].to(kv.device)
        if kv.shape[-1] == 512:
            kv_norm_rope_store(
                kv, weight, norm_eps, freq_cis, seq_len - plan.compress_ratio, loc,
                kvcache.view(-1, kvcache.shape[-1]), page_size, round_nope_bf16=True,
            )  # fmt: skip
        else:  # the kernel ropes a closing token's row at the group's first position
            index_k_store(kv, weight, norm_eps, freq_cis, seq_len - 1, loc, kvcache,
                          plan.compress_ratio, page_size)  # fmt: skip
    elif kv.shape[-1] == 512:
        kv_norm_rope_store_reference(
            kv, weight, norm_eps, freq_cis, positions, loc, kvcache, page_size,
            round_nope_bf16=True,
        )  # fmt: skip
    else:
        index_k_store_reference(kv, weight, norm_eps, freq_cis, positions, loc, kvcache, page_size)


def _planner(original, compress_ratio, **kwargs):
    from sglang.srt.layers.attention.dsv4.compressor_v2 import _use_online_compress

    if kwargs["req_to_token"].device.type != "cpu" or _use_online_compress(compress_ratio):
        return original(compress_ratio, **kwargs)
    return plan_on_cpu(
        compress_ratio,
        is_prefill=kwargs["is_prefill"],
        token_to_kv_pool=kwargs["token_to_kv_pool"],
        req_to_token=kwargs["req_to_token"],
        req_pool_indices=kwargs["req_pool_indices"],
        seq_lens=kwargs["seq_lens"],
        extend_lens=kwargs.get("extend_lens"),
        seq_lens_cpu=kwargs.get("seq_lens_cpu"),
        extend_lens_cpu=kwargs.get("extend_lens_cpu"),
    )


def _compress_forward(original, kv_score_buffer, kv_score_input, ape, plan, **kwargs):
    if kv_score_input.device.type != "cpu":
        return original(kv_score_buffer, kv_score_input, ape, plan, **kwargs)
    if kwargs.get("is_online") or plan.is_decode:
        raise NotImplementedError("the CPU compressor runs SGLang's prefill plans only")
    forward = compress_forward_triton if v4_kernels.use_triton() else compress_forward_torch
    return forward(
        kv_score_buffer, kv_score_input, ape, plan, head_dim=kwargs["head_dim"],
        compress_ratio=kwargs["compress_ratio"], out=kwargs.get("out"),
    )  # fmt: skip


def _compress_store(original, kv, plan, **kwargs):
    if kv.device.type != "cpu":
        return original(kv, plan, **kwargs)
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    unsupported = [name for name in ("use_fp4", "bf16_store", "fp8_2buff") if kwargs.get(name)] + (
        [] if KVLayout.parse(kwargs.get("layout", KVLayout.V4)) is KVLayout.V4 else ["layout"]
    )
    if unsupported or plan.is_decode:
        raise NotImplementedError(
            f"the CPU compressor store has V4's fp8 layout only (got {unsupported or 'decode'})"
        )
    compress_norm_rope_store_torch(
        kv, plan, norm_weight=kwargs["norm_weight"], norm_eps=kwargs["norm_eps"],
        freq_cis=kwargs["freq_cis"], out_loc=kwargs["out_loc"], kvcache=kwargs["kvcache"],
        page_size=kwargs["page_size"],
    )  # fmt: skip


def install() -> None:
    register_around(PLANNER, _planner)
    register_around(f"{COMPRESS}.compress_forward", _compress_forward)
    register_around(f"{COMPRESS}.compress_norm_rope_store", _compress_store)


HOOKS = {"v4_cpu_compressor": install}
