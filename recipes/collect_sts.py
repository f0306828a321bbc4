#!/usr/bin/env python3
"""Collect STS calibration data from the embedded DSPARK server (the plugin's recorder).

    python recipes/collect_sts.py --prompts prompts.jsonl --limit 160 --out-stem DIR/fit
    python recipes/collect_sts.py --benchmarks gsm8k,humaneval,mt-bench --limit 20 --out-stem DIR/held

Starts the embedded server on 127.0.0.1 with SGLANG_DSPARK_STS_COLLECT_PATH=<out-stem>, the
drafter WITHOUT its sts.json (the recorder wants raw logits), and verification of every draft
(SGLANG_DSPARK_SCHEDULER=async with SGLANG_DSPARK_SPS_PROFILE=0: a flat cost table, so no
window is trimmed and every position gets a label; SGLANG_DSPARK_PLAIN_ROUNDS=off as a guard:
every round drafts). Sends the prompts at --temperature
(default 0, greedy) and --concurrency, stops the server, and prints the number of blocks on disk
(<out-stem>.rank0.*.pt; fit them with `sglang-dspark calibrate`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompts", type=Path, help="JSONL with 'messages' (sglang-dspark data prompts)"
    )
    src.add_argument(
        "--benchmarks", help="comma-separated packaged eval sets (gsm8k, humaneval, mt-bench)"
    )
    parser.add_argument(
        "--skip-ids-from",
        type=Path,
        nargs="*",
        default=[],
        help="JSONL files whose 'id's are left out (e.g. the training data)",
    )
    parser.add_argument("--limit", type=int, default=160, help="prompts (per benchmark)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of the requests (1: the blocks T=1 traffic "
        "drafts and accepts; default 0, greedy)",
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--draft", type=Path, default=None, help="default: the embedded draft")
    parser.add_argument("--out-stem", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")

    from transformers import AutoTokenizer

    from sglang_dspark.calibration import load_data
    from sglang_dspark.data.generate import chat_prompt_ids as chat_ids_from_messages
    from sglang_dspark.evaluation.benchmarks import default_eval_dir, load_prompts
    from sglang_dspark.serving import embedded
    from sglang_dspark.serving.client import chat_prompt_ids, generate_ids
    from sglang_dspark.serving.server import SGLangServer, free_port

    paths = embedded.ensure()
    tok = AutoTokenizer.from_pretrained(paths.target)
    if args.prompts:
        skip = {
            json.loads(line)["id"]
            for f in args.skip_ids_from
            for line in f.read_text().splitlines()
            if line.strip()
        }
        rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("id") not in skip][: args.limit]
        prompt_ids = [chat_ids_from_messages(tok, r["messages"]) for r in rows]
    else:
        prompt_ids = [
            chat_prompt_ids(tok, p)
            for name in args.benchmarks.split(",")
            for p in load_prompts(default_eval_dir(), name, args.limit)
        ]
    draft = Path(tempfile.mkdtemp(prefix="sts-draft-"))
    for f in Path(args.draft or paths.draft).iterdir():
        if f.is_dir():  # draft_vocab/
            shutil.copytree(f, draft / f.name)
        elif f.name != embedded.STS_FILE:
            shutil.copy(f, draft / f.name)
    args.out_stem.parent.mkdir(parents=True, exist_ok=True)
    for old in args.out_stem.parent.glob(args.out_stem.name + ".rank*.pt"):
        old.unlink()
    env = embedded.launch_env(scheduler="async")
    # A plain round records no block: `async` takes none, and `off` keeps it so whatever the
    # scheduler.
    env.update(
        SGLANG_DSPARK_SPS_PROFILE="0",
        SGLANG_DSPARK_STS_COLLECT_PATH=str(args.out_stem),
        SGLANG_DSPARK_PLAIN_ROUNDS="off",
    )
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"collect-sts-{port}.log"
    from dataclasses import replace

    cmd = embedded.launch_command(replace(paths, draft=draft), port=port)
    print(f"{len(prompt_ids)} prompts x {args.max_new_tokens} tokens, server log {log}", flush=True)
    with SGLangServer(cmd, env, port, log) as server:
        from concurrent.futures import ThreadPoolExecutor

        from tqdm import tqdm

        with ThreadPoolExecutor(args.concurrency) as pool:
            jobs = pool.map(
                lambda ids: generate_ids(
                    server.base_url,
                    ids,
                    temperature=args.temperature,
                    max_new_tokens=args.max_new_tokens,
                ),
                prompt_ids,
            )
            for _ in tqdm(jobs, total=len(prompt_ids), desc="requests"):
                pass
    data = load_data(str(args.out_stem) + ".rank*.pt")
    print(f"{data.num_samples} blocks (gamma {data.gamma}) in {args.out_stem}.rank*.pt")
    shutil.rmtree(draft, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
