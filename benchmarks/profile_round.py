#!/usr/bin/env python3
"""Where a decode round's time goes: py-spy on the embedded server's scheduler under load.

    python benchmarks/profile_round.py --arm dspark --users 4 --temperature 1 [--seconds 40]

Starts one embedded server (`--arm plain|mtp1|dspark`, the launch `sglang-dspark embedded`
prints), keeps `--users` concurrent requests of `--max-tokens` tokens (`ignore_eos`, packaged
mt-bench prompts) running, and samples the scheduler process with `py-spy record` (50 Hz,
non-blocking) for `--seconds`. Rounds per second come from the responses finished under load
(verify rounds over users for a speculative arm, tokens over users for plain); a round's time
is split by each frame's inclusive share of the samples (the scheduler is busy the whole time
under load). Prints ms per round for the top frames below the worker's forward, and writes the
raw stacks (`--out`, py-spy's collapsed format) for a flame graph. Needs `py-spy` (`pip install
py-spy`; it reads another process's memory: root, or ptrace allowed).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def busiest_child(pid: int) -> int:
    """The process under `pid` (itself included) with the most CPU time: the scheduler."""
    import psutil

    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    return max(procs, key=lambda p: sum(p.cpu_times()[:2])).pid


def frame_shares(raw: Path) -> tuple[collections.Counter, int]:
    """Inclusive sample count per frame ("function (file)") from py-spy's collapsed stacks."""
    counts: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        total += int(n)
        names = set()
        for frame in stack.split(";"):
            func, _, where = frame.partition(" (")
            names.add(f"{func} ({where.split(':')[0].rsplit('/', 1)[-1]}")
        for name in names:
            counts[name] += int(n)
    return counts, total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", choices=("plain", "mtp1", "dspark"), default="dspark")
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None, help="keep the raw stacks here")
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        parser.error("py-spy is not installed: pip install py-spy")

    from transformers import AutoTokenizer

    from sglang_dspark import embedded
    from sglang_dspark.client import chat_prompt_ids, generate_many
    from sglang_dspark.evaluation.benchmarks import default_eval_dir, load_prompts
    from sglang_dspark.server import SGLangServer, free_port

    paths = embedded.ensure(dtype="bfloat16")
    port = free_port()
    cmd = embedded.launch_command(
        paths, port=port, speculative=args.arm != "plain",
        arm="dspark" if args.arm == "plain" else args.arm,
    )  # fmt: skip
    log = Path(tempfile.gettempdir()) / f"profile-round-{port}.log"
    raw = args.out or Path(tempfile.mkdtemp()) / "stacks.txt"
    with SGLangServer(cmd, embedded.launch_env(), port, log) as server:
        tok = AutoTokenizer.from_pretrained(paths.target)
        texts = load_prompts(default_eval_dir(), "mt-bench", args.users)
        prompts = [chat_prompt_ids(tok, t) for t in texts][: args.users]
        generate_many(server.base_url, prompts[:1], max_new_tokens=8)  # warm-up
        done = threading.Event()
        stats = {"tokens": 0, "rounds": 0, "seconds": 0.0}

        def load() -> None:
            while not done.is_set():
                t0 = time.perf_counter()
                outs = generate_many(
                    server.base_url, prompts, concurrency=args.users,
                    max_new_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=True,
                )  # fmt: skip
                stats["seconds"] += time.perf_counter() - t0
                stats["tokens"] += sum(len(o["output_ids"]) for o in outs)
                stats["rounds"] += sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        time.sleep(3)
        pid = busiest_child(server.proc.pid)
        print(f"profiling scheduler pid {pid} for {args.seconds:.0f} s ...", flush=True)
        subprocess.run(
            [spy, "record", "--pid", str(pid), "--rate", "50", "--nonblocking", "--duration",
             str(int(args.seconds)), "--format", "raw", "--output", str(raw)],
            check=True, capture_output=True,
        )  # fmt: skip
        done.set()
        worker.join()
    steps = stats["rounds"] if args.arm != "plain" else stats["tokens"]
    rounds_per_s = steps / args.users / stats["seconds"]
    ms = 1000 / rounds_per_s
    accept = stats["tokens"] / stats["rounds"] if stats["rounds"] else 1.0
    print(f"{args.arm}, {args.users} users, T={args.temperature:g}: {rounds_per_s:.2f} rounds/s, "
          f"{ms:.0f} ms a round, {accept:.2f} tokens a round per request")  # fmt: skip
    counts, total = frame_shares(raw)
    top = [(n, c) for n, c in counts.most_common() if c < 0.97 * total][: args.top]
    for name, c in top:
        print(f"{c / total:6.1%} {ms * c / total:7.1f} ms  {name}")
    print(f"raw stacks: {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
