#!/usr/bin/env python3
"""DeepSeek-V4's CPU paths that read only what a row can read, against reading everything.

    python benchmarks/v4_cpu_paths.py [--repeats 3] [--json FILE]

Side by side in one run, on the shapes the tiny V4's DSPARK server meets (a verify batch of 4
requests x 6 rows, 64 indexer heads, a page table 258 pages wide):

- the C4 indexer's logits: SGLang's `fp8_paged_mqa_logits_torch` on the whole page table, and
  through `v4_cpu_index_live_pages` on the live pages only (rows that read 3 compressed
  positions, and prefill-like rows that read up to 600);
- the sparse attention: every slot gathered (`-1` clamped to slot 0, SGLang's row reader) and
  the valid slots only (`v4_cpu_sparse_attention`), window 128 + C4 top-512, few valid;
- the Triton indexer query under Triton's interpreter (on CPU; compiled on a GPU): 16 heads a
  program (the kernel's default) and all 64 in one (the serving hook's choice on CPU).

Each pair is checked equal (bit for bit) before it is timed. Prints one table (ms, best of
--repeats) with the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "kernels"))
sys.path.insert(0, str(REPO / "benchmarks"))

from cpu_gemm import best_ms  # the benchmarks' timer (benchmarks/cpu_gemm.py)


def _fp8(torch, shape, gen):
    codes = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.uint8)
    codes |= torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8) << 7
    return codes.view(torch.float8_e4m3fn)


def indexer_cases(torch, gen):
    """(name, whole, live) callables for the indexer logits."""
    import inspect

    from dspark_kernels import kv_layout
    from sglang.srt.layers.attention.dsv4 import indexer

    from sglang_dspark.plugin import v4_cpu_index_pages

    upstream = inspect.unwrap(indexer.fp8_paged_mqa_logits_torch)
    pool_pages, heads, width = 36, 64, 258
    cache = kv_layout.new_index_cache(pool_pages)
    slots = torch.arange(pool_pages * 64)
    codes = _fp8(torch, (slots.numel(), 128), gen).view(torch.uint8)
    kv_layout.write_index_rows(cache, slots, codes, torch.rand(slots.numel(), generator=gen) + 0.5)
    cache = cache.view(-1, 64, 1, 132)
    cases = []
    for name, lens in (("verify, 24 rows of <= 3", [0, 1, 2] + [3] * 21),
                       ("prefill, 32 rows of <= 600", [i * 19 for i in range(32)])):  # fmt: skip
        rows = len(lens)
        table = torch.randint(0, pool_pages, (rows, width), generator=gen, dtype=torch.int32)
        args = (_fp8(torch, (rows, 1, heads, 128), gen), cache, torch.randn(rows, heads),
                torch.tensor(lens, dtype=torch.int32), table, None, 16512, False)  # fmt: skip
        whole = lambda a=args: upstream(*a)
        live = lambda a=args: v4_cpu_index_pages._live_pages_only(upstream, *a)
        cases.append((f"indexer logits, {name}", whole, live))
    return cases


def attention_case(torch, gen):
    from dspark_kernels import kv_layout
    from sglang.kernels.ops.attention.flash_mla_sm120 import _gather_and_dequant

    from sglang_dspark.plugin import v4_cpu_attention

    def cache(pages, page):
        raw = kv_layout.new_v4_cache(pages, page)
        n = pages * page
        kv_layout.write_v4_rows(raw, torch.arange(n), _fp8(torch, (n, 448), gen).view(torch.uint8),
                                torch.full((n, 7), 127, dtype=torch.uint8),
                                torch.randn(n, 64, generator=gen), page)  # fmt: skip
        return raw[:, : page * 584].view(pages, page, 1, 584)

    rows, heads = 24, 64
    swa, c4 = cache(1, 256), cache(2, 64)
    idx = torch.full((rows, 1, 128), -1, dtype=torch.int32)
    idx[:, :, :8] = torch.randint(0, 256, (rows, 1, 8), generator=gen, dtype=torch.int32)
    extra = torch.full((rows, 1, 512), -1, dtype=torch.int32)
    extra[:, :, :2] = torch.randint(0, 128, (rows, 1, 2), generator=gen, dtype=torch.int32)
    kwargs = {"q": torch.randn(rows, 1, heads, 512, generator=gen).to(torch.bfloat16),
              "k_cache": swa, "indices": idx, "topk_length": None,
              "attn_sink": torch.randn(heads, generator=gen), "head_dim_v": 512,
              "softmax_scale": 512**-0.5, "extra_k_cache": c4,
              "extra_indices_in_kvcache": extra}  # fmt: skip

    def whole_gather(k_cache, indices, topk_length):
        kv = _gather_and_dequant(k_cache, indices.clamp(min=0), k_cache.shape[1])
        return kv, indices < 0

    def whole():
        valid_only = v4_cpu_attention._slots
        v4_cpu_attention._slots = whole_gather
        try:
            return v4_cpu_attention.flash_mla_with_kvcache_torch(**kwargs)
        finally:
            v4_cpu_attention._slots = valid_only

    live = lambda: v4_cpu_attention.flash_mla_with_kvcache_torch(**kwargs)
    return "sparse attention, 24 rows, 8 + 2 valid of 640 slots", whole, live


def query_case(torch, gen):
    from dspark_kernels.indexer_query import indexer_query

    n, heads = 24, 64
    device = "cuda" if torch.cuda.is_available() else "cpu"
    freqs = torch.polar(torch.ones(4096, 32), torch.randn(4096, 32, generator=gen))
    args = (torch.randn(n, heads, 128, generator=gen).to(device, torch.bfloat16),
            torch.randn(n, heads, generator=gen).to(device, torch.bfloat16), 0.1, freqs.to(device),
            torch.randint(0, 4096, (n,), generator=gen).to(device))  # fmt: skip
    where = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    return (f"Triton indexer query ({where}), 24 rows", lambda: indexer_query(*args, block_h=16),
            lambda: indexer_query(*args, block_h=heads))  # fmt: skip


def _equal(torch, a, b) -> bool:
    if isinstance(a, tuple):
        return all(_equal(torch, x, y) for x, y in zip(a, b, strict=True))
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a.cpu(), b.cpu())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    import torch

    gen = torch.Generator().manual_seed(0)
    cases = [*indexer_cases(torch, gen), attention_case(torch, gen), query_case(torch, gen)]
    rows = []
    print(f"{'case':58s} {'whole ms':>10s} {'live ms':>10s} {'ratio':>7s}")
    for name, whole, live in cases:
        if not _equal(torch, whole(), live()):
            print(f"{name}: the two paths differ; not timed", file=sys.stderr)
            return 1
        w, lv = best_ms(whole, args.repeats), best_ms(live, args.repeats)
        rows.append({"case": name, "whole_ms": w, "live_ms": lv, "ratio": w / lv})
        print(f"{name:58s} {w:10.1f} {lv:10.1f} {w / lv:6.1f}x", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"torch_threads": torch.get_num_threads(), "rows": rows}))
    return 0


if __name__ == "__main__":
    if "TRITON_INTERPRET" not in os.environ:
        import importlib.util

        # before the first Triton import: the query kernel runs in the interpreter without a GPU
        if importlib.util.find_spec("torch") and not __import__("torch").cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    sys.exit(main())
