"""DeepSeek-V4's attention metadata on CPU: `v4_cpu_compression_metadata`, `v4_cpu_pinned_lists`.

`v4_cpu_compression_metadata`: DeepSeek-V4's compressed-attention metadata in torch on CPU.

Every V4 forward builds, per query row, where a C4 / C128 compressed entry is written and how
many compressed entries it reads (`DSV4AttnMetadata.init_compression_metadata`,
`layers/attention/deepseek_v4_backend.py:772`). SGLang has only the Triton kernel for it
(`_init_compressed_attn_metadata_kernel`, `kernels/ops/attention/dsv4/metadata_kernel.py:212`),
which fails on CPU with "0 active drivers".

The hook computes the same nine tensors with torch when the inputs are CPU tensors (same
dtypes and shapes; the kernel is integer arithmetic, so the results are identical). Per row
with sequence length `s`, position `p` and write slot `loc` (rows past `raw_out_loc` have no
write slot):
- C4: out-loc `loc // 4` where `s % 4 == 0` else 0, position `p & ~3`, length `s // 4` and
  `max(s // 4, 1)`; C128 the same with 128;
- C128 page indices (`compute_page_indices`): for `j < page_table.shape[1] * (page_size // 128)`,
  `page_table[row, j // c128_page] * c128_page + j % c128_page` where `j < s // 128`, else -1.

`v4_cpu_pinned_lists`: the backend moves host lists to its device through pinned memory
(`DeepseekV4AttnBackend._move_to_device`, `deepseek_v4_backend.py:1382`: `pin_memory=True`,
"Found no NVIDIA driver"), e.g. a DSPARK draft block's extend lengths
(`_draft_block_extend_lens`). On a CPU backend the hook builds the int32 tensor directly.
"""

from __future__ import annotations

import torch

from sglang_dspark.plugin.registry import register_around

TARGET = "sglang.kernels.ops.attention.dsv4.metadata_kernel._init_compressed_attn_metadata_triton"


def compression_metadata_torch(
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    raw_out_loc: torch.Tensor,
    page_table: torch.Tensor | None = None,
    page_size: int = 0,
    compute_page_indices: bool = True,
):
    """Torch twin of `_init_compressed_attn_metadata_triton` (same outputs, same dtypes)."""
    bs, num_write = seq_lens.shape[0], raw_out_loc.shape[0]
    assert num_write <= bs, f"raw_out_loc has {num_write} rows, expected at most {bs}"
    s = seq_lens.to(torch.int64)
    p = positions.to(torch.int64)
    loc = raw_out_loc.to(torch.int64)
    s_w = s[:num_write]
    out = []
    for ratio in (4, 128):
        out_loc = torch.where(s_w % ratio == 0, loc // ratio, torch.zeros_like(loc))
        lens = s // ratio
        out += [
            out_loc,
            (p & ~(ratio - 1)).to(torch.int32),
            lens.to(torch.int32),
            lens.clamp(min=1).to(torch.int32),
        ]
    c128_page_indices = None
    if compute_page_indices:
        assert page_table is not None, "page_table required when compute_page_indices=True"
        assert page_size >= 128 and page_size % 128 == 0, (
            "page_size must be a multiple of 128 when compute_page_indices=True"
        )
        c128_page = page_size // 128
        width = c128_page * page_table.shape[1]
        j = torch.arange(width, dtype=torch.int64)
        pages = page_table.to(torch.int64)[:, j // c128_page]
        slots = pages * c128_page + j % c128_page
        valid = j.unsqueeze(0) < (s // 128).unsqueeze(1)
        c128_page_indices = torch.where(valid, slots, torch.full_like(slots, -1)).to(torch.int32)
    return (*out, c128_page_indices)


def _metadata(original, seq_lens, positions, raw_out_loc, page_table=None, page_size=0,
              compute_page_indices=True):  # fmt: skip
    if seq_lens.device.type == "cpu":
        return compression_metadata_torch(
            seq_lens, positions, raw_out_loc, page_table, page_size, compute_page_indices
        )
    return original(seq_lens, positions, raw_out_loc, page_table, page_size, compute_page_indices)


def install() -> None:
    register_around(TARGET, _metadata)


def _move_to_device(original, backend, x):
    if backend.device.type != "cpu":
        return original(backend, x)
    return torch.tensor(x, dtype=torch.int32)


def install_pinned_lists() -> None:
    register_around(
        "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend._move_to_device",
        _move_to_device,
    )


HOOKS = {
    "v4_cpu_compression_metadata": install,
    "v4_cpu_pinned_lists": install_pinned_lists,
}
