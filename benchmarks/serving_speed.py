#!/usr/bin/env python3
"""Tokens/s of the embedded server with and without DSPARK, measured side by side.

    python benchmarks/serving_speed.py [--concurrency 1,4] [--requests 8] [--max-new-tokens 128]
        [--temperature 1] [--mtp1] [--variant LABEL:ENV=VALUE ...]

Starts the plain server and each DSPARK server on 127.0.0.1 at once (all `--sleep-on-idle`, so
an idle server takes no CPU), then measures them interleaved: in each of `--rounds` rounds every
server serves every concurrency level in turn, with the same prompts from the packaged eval sets. A
shared machine's speed drifts over minutes; interleaving puts that drift on every server alike,
so the ratio DSPARK / plain is measured side by side. Prints tokens/s, the accept length and
the ratio to plain; greedy unless --temperature; stops every server; writes JSON with --json.
`--mtp1` adds the MTP-1 baseline; `--variant LABEL:ENV=VALUE` adds a DSPARK server (the first
draft) started with one more environment variable, e.g. a hook turned off
(`off:SGLANG_DSPARK_DISABLE_HOOKS=cpu_sampled_markov_step`), for a paired A/B of a change.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

from sglang_dspark.evaluation.benchmarks import default_eval_dir

REPO = Path(__file__).resolve().parents[1]


def load_prompts(eval_dir: Path, n: int) -> list[str]:
    from sglang_dspark.evaluation.benchmarks import DEFAULT_BENCHMARKS
    from sglang_dspark.evaluation.benchmarks import load_prompts as load_benchmark

    prompts = []
    for name in DEFAULT_BENCHMARKS:
        prompts += load_benchmark(eval_dir, name, n // 3 + 1)
    return prompts[:n]


def measure(server, prompt_ids, concurrency: int, max_new_tokens: int, temperature: float) -> dict:
    from sglang_dspark.client import generate_many

    t0 = time.perf_counter()
    outs = generate_many(
        server.base_url, prompt_ids, concurrency=concurrency, max_new_tokens=max_new_tokens,
        temperature=temperature, ignore_eos=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    verify = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
    return {
        "concurrency": concurrency,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "accept_len": (tokens / verify) if verify else None,
    }


def merge(parts: list[dict]) -> dict:
    """One level's measurements over all rounds: tokens over total seconds."""
    tokens, seconds = sum(p["tokens"] for p in parts), sum(p["seconds"] for p in parts)
    verify = sum(p["tokens"] / p["accept_len"] for p in parts if p["accept_len"])
    return {
        "concurrency": parts[0]["concurrency"], "tokens": tokens, "seconds": seconds,
        "tokens_per_s": tokens / seconds, "accept_len": tokens / verify if verify else None,
        "rounds": [p["tokens_per_s"] for p in parts],
    }  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per level")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eval-dir", type=Path, default=default_eval_dir())
    parser.add_argument(
        "--draft", type=Path, action="append", default=None,
        help="draft dir to compare (repeatable; default: the embedded draft)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--mtp1", action="store_true", help="add the MTP-1 baseline server")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="LABEL:ENV=VALUE",
        help="add a DSPARK server (first draft) with one more environment variable (repeatable)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results here")
    args = parser.parse_args(argv)
    variants = []
    for spec in args.variant:
        label, _, assignment = spec.partition(":")
        key, eq, value = assignment.partition("=")
        if not (label and key and eq):
            parser.error(f"--variant {spec!r}: expected LABEL:ENV=VALUE")
        variants.append((label, key, value))

    from dataclasses import replace

    from transformers import AutoTokenizer

    from sglang_dspark import embedded
    from sglang_dspark.client import chat_prompt_ids, generate_many
    from sglang_dspark.server import SGLangServer, free_port

    paths = embedded.ensure(dtype=args.dtype)
    drafts = args.draft or [paths.draft]
    tok = AutoTokenizer.from_pretrained(paths.target)
    prompt_ids = [chat_prompt_ids(tok, p) for p in load_prompts(args.eval_dir, args.requests)]
    levels = [int(x) for x in args.concurrency.split(",")]
    runs = [("plain", "plain", paths, {})] + [
        (f"dspark:{d}", "dspark", replace(paths, draft=d), {}) for d in drafts
    ]
    if args.mtp1:
        runs.append(("mtp1", "mtp1", paths, {}))
    runs += [(f"dspark:{label}", "dspark", replace(paths, draft=drafts[0]), {key: value})
             for label, key, value in variants]  # fmt: skip
    servers = {}
    with contextlib.ExitStack() as stack:
        for label, arm, run_paths, env_extra in runs:
            port = free_port()
            log = Path(tempfile.gettempdir()) / f"bench-{port}.log"
            cmd = embedded.launch_command(
                run_paths, port=port, dtype=args.dtype, speculative=arm != "plain", arm=arm
            )
            server = SGLangServer(cmd, {**embedded.launch_env(), **env_extra}, port, log)
            servers[label] = stack.enter_context(server)
            generate_many(servers[label].base_url, prompt_ids[:2], max_new_tokens=8)  # warm-up
        parts = {label: {c: [] for c in levels} for label in servers}
        for r in range(args.rounds):
            for c in levels:
                for label, server in servers.items():
                    parts[label][c].append(
                        measure(server, prompt_ids, c, args.max_new_tokens, args.temperature)
                    )
                    print(f"round {r + 1}/{args.rounds} concurrency {c} {label[-40:]}: "
                          f"{parts[label][c][-1]['tokens_per_s']:.2f} tok/s", flush=True)  # fmt: skip
    results = {label: [merge(parts[label][c]) for c in levels] for label in servers}
    print(
        f"\nembedded server, {args.dtype}, {len(prompt_ids)} requests x {args.max_new_tokens} tokens, "
        f"{args.rounds} interleaved rounds, temperature {args.temperature:g}"
    )
    print(f"{'server':<48} {'conc':>4} {'plain tok/s':>12} {'tok/s':>13} {'accept':>7} {'ratio':>6}")
    for label, rows in results.items():
        if label == "plain":
            continue
        for p, d in zip(results["plain"], rows):
            d["ratio_vs_plain"] = d["tokens_per_s"] / p["tokens_per_s"]
            print(
                f"{label.removeprefix('dspark:')[-48:]:<48} {p['concurrency']:>4} {p['tokens_per_s']:>12.2f} "
                f"{d['tokens_per_s']:>13.2f} {d['accept_len'] or 0:>7.2f} {d['ratio_vs_plain']:>6.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
