"""`v4_cpu_index_topk`: the C4 indexer's top-k on CPU by `dspark_kernels`.

On CPU the C4 indexer (`C4IndexerBackendMixin.forward_c4_indexer`,
`layers/attention/dsv4/indexer.py`) scores every compressed position with SGLang's torch
`fp8_paged_mqa_logits_torch` and, with the torch top-k backend that `v4_cpu_defaults`
declares, selects with `topk_transform_pytorch_vectorized`: per row the `topk` best positions
(a row with `seq_lens <= topk` whole and in order), written as pool slots and positions, `-1`
past the valid count. The hook routes that selection, on CPU tensors, to `dspark_kernels`
(`SGLANG_DSPARK_V4_KERNELS`, `v4_kernels`):

- `reference` (default): `topk_transform_reference`, the same `torch.topk(sorted=False)` call
  on the same masked logits: the same slots and positions in the same order as SGLang's torch
  path, ties included;
- `triton`: `topk_transform`, the selection stage of `index_topk`'s Triton kernel (bitonic merge
  of packed (logit, position) keys) over SGLang's logits. The same positions wherever a row's
  `topk`-th logit is not tied with one left out; among logits tied across that boundary it keeps
  the largest positions, where `torch.topk` keeps an unspecified subset (libstdc++'s
  `nth_element`). A selected row comes sorted by logit, then position, descending; SGLang's
  order is unspecified (`sorted=False`; its CUDA kernel's "in no particular order"). The
  consumer, the sparse attention, takes the slots as a set (a softmax over them; float32 sums
  in another order).

The logits stay SGLang's (bf16 products): the fused `index_topk` kernel computes float32
logits, whose selection differs from SGLang's wherever the bf16 rounding reorders two logits.
On GPUs the hook calls SGLang's function. The hook logs its implementation at its first call in
each process, and checks at start-up that `forward_c4_indexer` still calls the hooked name.
"""

from __future__ import annotations

import functools
import logging

from sglang_dspark.plugin import v4_kernels
from sglang_dspark.plugin.registry import applied_check, reads_name, register_around

logger = logging.getLogger(__name__)

INDEXER = "sglang.srt.layers.attention.dsv4.indexer"
TARGET = f"{INDEXER}.topk_transform_pytorch_vectorized"
CALLER = f"{INDEXER}.C4IndexerBackendMixin.forward_c4_indexer"


def index_topk_transform(scores, seq_lens, page_tables, out_page_indices, page_size,
                         out_raw_indices=None, kernels: str | None = None) -> None:  # fmt: skip
    """`topk_transform_pytorch_vectorized` by `dspark_kernels`: the reference, or the Triton
    kernel with `kernels="triton"` (default: `SGLANG_DSPARK_V4_KERNELS`)."""
    topk = out_page_indices.shape[1]
    choice = kernels or v4_kernels.v4_kernels()
    if choice == v4_kernels.TRITON:
        from dspark_kernels.index_topk import topk_transform

        if scores.device.type == "cpu":
            v4_kernels.require_interpreter()
        _announce("topk_transform (Triton)", topk)
        slots, raw = topk_transform(scores, seq_lens, page_tables, topk, page_size)
    else:
        from dspark_kernels.index_topk import topk_transform_reference

        _announce("topk_transform_reference", topk)
        slots, raw = topk_transform_reference(scores, seq_lens, page_tables, topk, page_size)
    out_page_indices.copy_(slots)
    if out_raw_indices is not None:
        out_raw_indices.copy_(raw)


@functools.cache
def _announce(implementation: str, topk: int) -> None:
    logger.info("sglang-dspark: C4 indexer top-%d by dspark_kernels' %s", topk, implementation)


def _topk_transform(original, scores, seq_lens, page_tables, out_page_indices, page_size,
                    out_raw_indices=None):  # fmt: skip
    if scores.device.type != "cpu":
        return original(scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices)
    index_topk_transform(
        scores, seq_lens, page_tables, out_page_indices, page_size, out_raw_indices
    )


@applied_check("v4_cpu_index_topk")
def _caller_reads_the_hooked_name() -> str | None:
    if not reads_name(CALLER, TARGET):
        return (
            f"{CALLER} no longer calls {TARGET}: the C4 indexer's top-k on CPU would bypass "
            "dspark_kernels"
        )
    return None


def install() -> None:
    register_around(TARGET, _topk_transform)


HOOKS = {"v4_cpu_index_topk": install}
