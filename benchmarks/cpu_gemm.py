#!/usr/bin/env python3
"""The linears of one target forward, bf16 GEMM against `cpu_half_gemm_fp32`'s float32 path.

    python benchmarks/cpu_gemm.py [--target DIR] [--rows 1,2,4,6,8,16,32,64] [--repeats 3]

Builds the weight matrices of the target's decoder layers (q/k/v, o, gate/up, down for every
layer, random bf16 values of the checkpoint's shapes: a forward reads each once, as in serving)
and its LM head, and times, for each row count, the whole set with torch's bf16 `F.linear` and
with `sglang_dspark.plugin.cpu_gemm.linear` forced to float32 (the float32 copies made before
timing), side by side in one run. Prints one table (ms, best of --repeats) and the ratio; the
row count where the float32 path starts to win is the hook's `SGLANG_DSPARK_CPU_GEMM_MIN_ROWS`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def shapes(config: dict) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads", heads)
    hd = config.get("head_dim", h // heads)
    layer = [(hd * (heads + 2 * kv), h), (h, hd * heads), (2 * inter, h), (h, inter)]
    return layer * config["num_hidden_layers"], (config["vocab_size"], h)


def best_ms(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return 1e3 * min(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=None, help="checkpoint dir (default: SmolLM2)")
    ap.add_argument("--rows", default="1,2,4,6,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    os.environ["SGLANG_DSPARK_CPU_GEMM"] = "float32"
    os.environ["SGLANG_DSPARK_CPU_GEMM_MIN_ROWS"] = "1"
    from sglang_dspark.plugin import cpu_gemm

    cpu_gemm.settings.cache_clear()
    target = args.target
    if target is None:
        from sglang_dspark.serving.smollm2 import ensure_smollm2

        target = ensure_smollm2(dtype="bfloat16")
    config = json.loads((Path(target) / "config.json").read_text())
    layer_shapes, head_shape = shapes(config)
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(s, generator=g).bfloat16() for s in layer_shapes]
    head = torch.randn(head_shape, generator=g).bfloat16()
    for w in (*layers, head):
        cpu_gemm.fp32_copy(w)

    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=g).bfloat16() for k in {s[1] for s in layer_shapes}}

        def run(fn, ws, xs=xs):
            return lambda: [fn(xs[w.shape[1]], w) for w in ws]

        r = {"rows": rows}
        for part, ws in (("layers", layers), ("lm_head", [head])):
            r[f"{part}_bf16_ms"] = best_ms(run(F.linear, ws), args.repeats)
            r[f"{part}_fp32_ms"] = best_ms(run(cpu_gemm.linear, ws), args.repeats)
        results.append(r)
        print(f"rows {rows}: done", file=sys.stderr)

    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, oneDNN bf16 GEMM: "
          f"{torch.ops.mkldnn._is_mkldnn_bf16_supported()}; {config['num_hidden_layers']} layers "
          f"+ LM head {head_shape[0]}x{head_shape[1]} (ms, best of {args.repeats})")  # fmt: skip
    print(
        "| rows | layers bf16 | layers float32 | ratio | LM head bf16 | LM head float32 | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['rows']} | {r['layers_bf16_ms']:.1f} | {r['layers_fp32_ms']:.1f} | "
              f"{r['layers_bf16_ms'] / r['layers_fp32_ms']:.2f}x | {r['lm_head_bf16_ms']:.1f} | "
              f"{r['lm_head_fp32_ms']:.1f} | {r['lm_head_bf16_ms'] / r['lm_head_fp32_ms']:.2f}x |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
