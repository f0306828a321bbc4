#!/usr/bin/env python3
"""Confidence-scheduled verification on the embedded server: no speculation vs DSPARK modes.

    python benchmarks/scheduler_modes.py [--concurrency 1,4,16] [--requests 16] [--max-new-tokens 64]

Starts, one at a time on 127.0.0.1, the plain server and the DSPARK server with
SGLANG_DSPARK_SCHEDULER=static (verify all), async (upstream's planner) and sync (Algorithm 1),
all with the same drafter, SPS table (profiled at start-up, cached) and STS calibration. At
each concurrency level it sends the same greedy requests from the packaged eval sets and prints:

- tokens/s/user: each request's completion tokens over its own latency, averaged;
- aggregate tokens/s: all completion tokens over the wall time of the level;
- accept len: completion tokens per verify step;
- cap len: the mean scheduled verify window (SGLang's `spec_cap_length`, read from the
  server's decode log lines during the level);
- ratios of each mode to static and to no speculation.

Greedy, ignore_eos, so every mode generates the same number of tokens. Prints a table and
writes JSON (--json). Not a test: speeds depend on the machine; ratios are measured side by
side in one run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_dspark.evaluation.benchmarks import default_eval_dir

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

MODES = ["static", "async", "sync"]
CAP_LEN = re.compile(r"cap len: ([0-9.]+)")


def _one(base_url: str, ids: list[int], max_new_tokens: int) -> tuple[dict, float]:
    from sglang_dspark.client import generate_many

    t0 = time.perf_counter()
    out = generate_many(
        base_url,
        [ids],
        concurrency=1,
        max_new_tokens=max_new_tokens,
        temperature=0,
        ignore_eos=True,
    )[0]
    return out, time.perf_counter() - t0


def measure(server, prompt_ids, concurrency: int, max_new_tokens: int, log: Path) -> dict:
    start = log.stat().st_size if log.exists() else 0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda ids: _one(server.base_url, ids, max_new_tokens), prompt_ids))
    wall = time.perf_counter() - t0
    with open(log, "rb") as fh:
        fh.seek(start)
        caps = [float(x) for x in CAP_LEN.findall(fh.read().decode(errors="replace"))]
    tokens = sum(len(o["output_ids"]) for o, _ in done)
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o, _ in done)
    return {
        "concurrency": concurrency,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "tokens_per_s_per_user": sum(len(o["output_ids"]) / s for o, s in done) / len(done),
        "accept_len": tokens / verify if verify else None,
        "cap_len": sum(caps) / len(caps) if caps else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--eval-dir", type=Path, default=default_eval_dir())
    parser.add_argument("--draft", type=Path, default=None, help="default: the embedded draft")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from dataclasses import replace

    from serving_speed import load_prompts
    from transformers import AutoTokenizer

    from sglang_dspark import embedded
    from sglang_dspark.client import chat_prompt_ids, generate_many
    from sglang_dspark.server import SGLangServer, free_port

    paths = embedded.ensure(dtype=args.dtype)
    if args.draft:
        paths = replace(paths, draft=args.draft)
    tok = AutoTokenizer.from_pretrained(paths.target)
    prompt_ids = [chat_prompt_ids(tok, p) for p in load_prompts(args.eval_dir, args.requests)]
    levels = [int(x) for x in args.concurrency.split(",")]
    runs = [("none", None)] + [(m, m) for m in args.modes.split(",")]
    results: dict[str, list[dict]] = {}
    for label, mode in runs:
        port = free_port()
        log = Path(tempfile.gettempdir()) / f"bench-sched-{label}-{port}.log"
        cmd = embedded.launch_command(
            paths,
            port=port,
            dtype=args.dtype,
            speculative=mode is not None,
            extra=["--decode-log-interval", "4"],
        )
        env = embedded.launch_env(scheduler=mode or "static")
        with SGLangServer(cmd, env, port, log) as server:
            generate_many(server.base_url, prompt_ids[:2], max_new_tokens=8)  # warm-up
            results[label] = [
                measure(server, prompt_ids, c, args.max_new_tokens, log) for c in levels
            ]
            print(
                f"{label}: "
                + ", ".join(
                    f"c={r['concurrency']} {r['tokens_per_s']:.1f} tok/s" for r in results[label]
                ),
                flush=True,
            )

    print(
        f"\nembedded server, {args.dtype}, {len(prompt_ids)} requests x {args.max_new_tokens} "
        f"tokens, draft {paths.draft}"
    )
    head = (
        f"{'mode':<7} {'conc':>4} {'tok/s/user':>10} {'agg tok/s':>9} {'accept':>6} "
        f"{'cap len':>7} {'vs none':>7} {'vs static':>9}"
    )
    print(head)
    for label, rows in results.items():
        for i, r in enumerate(rows):
            r["ratio_vs_none"] = r["tokens_per_s"] / results["none"][i]["tokens_per_s"]
            if "static" in results:
                r["ratio_vs_static"] = r["tokens_per_s"] / results["static"][i]["tokens_per_s"]
            print(
                f"{label:<7} {r['concurrency']:>4} {r['tokens_per_s_per_user']:>10.2f} "
                f"{r['tokens_per_s']:>9.2f} {r['accept_len'] or 0:>6.2f} "
                f"{r['cap_len'] or 0:>7.2f} {r['ratio_vs_none']:>7.2f} "
                f"{r.get('ratio_vs_static', float('nan')):>9.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
