"""`v4_cpu_norm_rope`: DeepSeek-V4's fused norm / RoPE / KV-store kernels in torch on CPU.

`MQALayer` prepares its query and stores its sliding-window KV through JIT CUDA kernels of
`kernels/ops/attention/dsv4/norm_rope.py` (on CPU the JIT build fails: "Failed to build JIT
module sgl_kernel_jit_dpsk_v4_main_q_norm_rope..."):
- `fused_q_norm_rope` (`models/deepseek_v4.py:1823`): per-head RMSNorm without weight, RoPE on
  the trailing 64 dims (`main_norm_rope.cuh`, `FusedQNormRopeKernel`);
- `fused_k_norm_rope_flashmla` (the pool's `set_swa_key_buffer_radix_fused_norm_rope`):
  RMSNorm with `kv_norm`, RoPE, and the fp8 pack into the 584-byte V4 SWA row;
- `fused_rope_inplace` (`deepseek_v4.py:2980`): the inverse RoPE on the attention output;
- `fused_q_indexer_rope_hadamard_quant` (the C4 indexer's query): RoPE, 128-point Hadamard,
  e4m3 with a float32 scale per head, and the head weights times that scale.

On CPU tensors the hook runs torch versions with the kernels' rounding: the query norm rounds to
the activation dtype before its RoPE (as the kernel's `cast<DType>(x * norm_factor)`), RoPE
pairs are (even, odd) dims rotated in float32 and rounded once; the KV store and the indexer
query are `dspark_kernels`' references (`kv_norm_rope_store_reference`,
`indexer_query_reference`, byte-exact against these kernels on the kernel tests), or with
`SGLANG_DSPARK_V4_KERNELS=triton` its Triton kernels (`kv_norm_rope_store`, `indexer_query`;
see `v4_kernels`). Under Triton's interpreter the indexer query takes every head in one tile
(the same bytes as the kernel's 16-head tile; the interpreter's cost is per program: the tiny
V4's DSPARK server with Triton kernels served its three test prompts in 136 s instead of 281).
"""

from __future__ import annotations

import torch

from sglang_dspark.plugin import v4_kernels
from sglang_dspark.plugin.registry import register_around

NORM_ROPE = "sglang.kernels.ops.attention.dsv4.norm_rope"


def _freqs(freqs_cis: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f = freqs_cis[positions.long()]
    return f.real.float(), f.imag.float()


def rope_pairs_(x: torch.Tensor, freqs_cis: torch.Tensor, positions: torch.Tensor,
                inverse: bool = False) -> None:  # fmt: skip
    """Rotate `x` `[T, ..., 2P]` in place: pair `(x[2p], x[2p+1])` by `freqs_cis[pos, p]`
    (conjugate when `inverse`), in float32, rounded once to `x`'s dtype."""
    cos, sin = _freqs(freqs_cis, positions)
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    pairs = x.float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    out = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
    x.copy_(out.to(x.dtype))


def fused_q_norm_rope_torch(q_input, q_output, eps, freqs_cis, positions) -> None:
    rope_dim = 2 * freqs_cis.shape[-1]
    x = q_input
    if eps is not None:
        xf = q_input.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(q_input.dtype)
    y = x.clone() if x is q_input else x
    rope_pairs_(y[..., -rope_dim:], freqs_cis, positions)
    q_output.copy_(y.to(q_output.dtype) if q_output.dtype != y.dtype else y)


def _q_norm_rope(original, q_input, q_output, eps, freqs_cis, positions):
    if q_input.device.type != "cpu":
        return original(q_input, q_output, eps, freqs_cis, positions)
    fused_q_norm_rope_torch(q_input, q_output, eps, freqs_cis, positions)


def _rope_inplace(original, q, k, freqs_cis, positions, inverse=False):
    if q.device.type != "cpu":
        return original(q, k, freqs_cis, positions, inverse)
    rope_pairs_(q, freqs_cis, positions, inverse)
    if k is not None:
        rope_pairs_(k, freqs_cis, positions, inverse)


def table_positions(positions: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """`positions` as rows of `freqs_cis`, negative ones counted from its end, as the references'
    torch indexing reads them (a padding row's position -1: the table's last row). The Triton
    kernels take a position as a row offset: -1 would read before the table."""
    return torch.where(positions < 0, positions + freqs_cis.shape[0], positions)


def swa_kv_store(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size,
                 kernels: str | None = None) -> None:  # fmt: skip
    """`fused_k_norm_rope_flashmla` (V4 layout) by `dspark_kernels`: the reference, or the
    Triton kernel with `kernels="triton"` (default: `SGLANG_DSPARK_V4_KERNELS`)."""
    if (kernels or v4_kernels.v4_kernels()) == v4_kernels.TRITON:
        from dspark_kernels.kv_store import kv_norm_rope_store

        if kv.device.type == "cpu":
            v4_kernels.require_interpreter()
        kv = kv if kv.stride(-1) == 1 else kv.contiguous()
        pages = kvcache.view(-1, kvcache.shape[-1])
        positions = table_positions(positions, freqs_cis)
        kv_norm_rope_store(kv, kv_weight, eps, freqs_cis, positions, out_loc, pages, page_size)
    else:
        from dspark_kernels.kv_store import kv_norm_rope_store_reference

        kv_norm_rope_store_reference(
            kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size
        )


def indexer_query_fp8(q_input, weight, weight_scale, freqs_cis, positions,
                      kernels: str | None = None):  # fmt: skip
    """`fused_q_indexer_rope_hadamard_quant` by `dspark_kernels` (reference or Triton, as
    `swa_kv_store`): (q_fp8 `[n, H, 128]`, weights `[n, H, 1]`)."""
    if (kernels or v4_kernels.v4_kernels()) == v4_kernels.TRITON:
        from dspark_kernels.indexer_query import indexer_query

        tile = {}
        if q_input.device.type == "cpu":
            v4_kernels.require_interpreter()
            # the interpreter runs one Python program per (token, head tile): all heads in one
            # tile, the same bytes as the kernel's 16 (kernel tests), 4x fewer programs for 64
            tile["block_h"] = 1 << max(0, q_input.shape[1] - 1).bit_length()
        positions = table_positions(positions, freqs_cis)
        return indexer_query(
            q_input.contiguous(), weight.contiguous(), weight_scale, freqs_cis, positions, **tile
        )
    from dspark_kernels.indexer_query import indexer_query_reference

    return indexer_query_reference(q_input, weight, weight_scale, freqs_cis, positions)


def _k_norm_rope_store(original, kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache,
                       page_size, layout="v4", q=None):  # fmt: skip
    if kv.device.type != "cpu":
        return original(
            kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size, layout, q
        )
    from sglang.kernels.ops.attention.dsv4.kv_layout import KVLayout

    if KVLayout.parse(layout) is not KVLayout.V4 or q is not None:
        raise NotImplementedError("the CPU KV store writes V4's layout only, without q rope")
    swa_kv_store(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size)


def _indexer_query(original, q_input, weight, weight_scale, freqs_cis, positions):
    if q_input.device.type != "cpu":
        return original(q_input, weight, weight_scale, freqs_cis, positions)
    return indexer_query_fp8(q_input, weight, weight_scale, freqs_cis, positions)


def install() -> None:
    register_around(f"{NORM_ROPE}.fused_q_norm_rope", _q_norm_rope)
    register_around(f"{NORM_ROPE}.fused_rope_inplace", _rope_inplace)
    register_around(f"{NORM_ROPE}.fused_k_norm_rope_flashmla", _k_norm_rope_store)
    register_around(f"{NORM_ROPE}.fused_q_indexer_rope_hadamard_quant", _indexer_query)


HOOKS = {"v4_cpu_norm_rope": install}
