"""`v4_cpu_index_live_pages`: the C4 indexer on CPU scores only the pages its rows can read.

On CPU the C4 indexer (`C4IndexerBackendMixin.forward_c4_indexer`,
`layers/attention/dsv4/indexer.py`) scores with SGLang's torch `fp8_paged_mqa_logits_torch`
(`SGLANG_FP8_PAGED_MQA_LOGITS_TORCH`, set by `v4_cpu_defaults`). That function gathers,
dequantizes and multiplies every page of the page table it is given, then zeroes the scores
past each row's `seq_lens`. The table is as wide as the model's context allows, not the batch:
258 pages (16 512 compressed positions) for the tiny V4, so a verify batch of 24 rows that
hold 3 compressed positions each gathers and multiplies `[24, 16512, 128]` per C4 layer. Measured
with py-spy on the tiny V4's DSPARK server (48 sampled continuations of a 5-token prompt,
every draft verified), this was 67% of the scheduler's time.

The hook passes the function the first `ceil(max(seq_lens) / 64)` columns of the table (at
least one). Every score below a row's length is the same product of the same page row, and
every score past it was zero and stays zero (SGLang pads its output to `max_seq_len` with
zeros): the output is bit-identical (`tests/test_v4_index_live_pages.py`). On other devices
the hook calls SGLang's function as it is: reading `max(seq_lens)` is a host sync, which a
CUDA graph cannot hold, and GPUs do not run this function. Start-up refuses a
`forward_c4_indexer` that no longer calls the hooked name.
"""

from __future__ import annotations

from sglang_dspark.plugin.registry import applied_check, reads_name, register_around

INDEXER = "sglang.srt.layers.attention.dsv4.indexer"
TARGET = f"{INDEXER}.fp8_paged_mqa_logits_torch"
CALLER = f"{INDEXER}.C4IndexerBackendMixin.forward_c4_indexer"


def live_pages(seq_lens, block_size: int) -> int:
    """The page-table columns any row reads: `ceil(max(seq_lens) / block_size)`, at least 1."""
    longest = int(seq_lens.max()) if seq_lens.numel() else 0
    return max(1, -(-longest // block_size))


def _live_pages_only(original, q_fp8, kvcache_fp8, weight, seq_lens, page_table,
                     deep_gemm_metadata, max_seq_len, clean_logits=True):  # fmt: skip
    if page_table.device.type == "cpu":
        page_table = page_table[:, : live_pages(seq_lens, kvcache_fp8.shape[1])]
    return original(q_fp8, kvcache_fp8, weight, seq_lens, page_table, deep_gemm_metadata,
                    max_seq_len, clean_logits)  # fmt: skip


@applied_check("v4_cpu_index_live_pages")
def _caller_reads_the_hooked_name() -> str | None:
    if not reads_name(CALLER, TARGET):
        return (
            f"{CALLER} no longer calls {TARGET}: on CPU the C4 indexer would score every page "
            "of its page table"
        )
    return None


def install() -> None:
    register_around(TARGET, _live_pages_only)


HOOKS = {"v4_cpu_index_live_pages": install}
