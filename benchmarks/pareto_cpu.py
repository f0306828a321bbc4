#!/usr/bin/env python3
"""DSpark against MTP-1 and plain decoding on the embedded CPU default: the Pareto report.

    python benchmarks/pareto_cpu.py --out docs/pareto-cpu [--users 1,2,4,8,16] [--stage-seconds 40]

Arms (same target, same prompts, same output lengths):

- `plain`: no speculation;
- `mtp1`: the MTP-1 baseline (SGLang's EAGLE3 worker, one draft token per round, the shipped
  MTP-style drafter; `sglang-dspark embedded --arm mtp1 --print-command`);
- `dspark-static`, `dspark-sync`, `dspark-async`: DSPARK with the shipped drafter under each
  `SGLANG_DSPARK_SCHEDULER` mode (static verifies every draft; sync is the embedded default).

Every server is started at once (`--sleep-on-idle`: an idle one takes no CPU). Then, for each
round and each concurrency level, every arm in turn (the order rotates from level to level)
serves one `locust -f loadtest/sla.py` stage at that level, so the drift of a shared machine
falls on every arm alike. Each arm's stages are merged into `arms/<arm>/sla_summary.json`
(rounds averaged per level) and `sglang-dspark pareto` draws the figures: `pareto.png`
(aggregate output tok/s against tok/s per user, frontiers, DSpark's gains over MTP-1),
`verify_budget.png`, `pareto.csv`, `pareto.json`; `report.md` holds the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import fmean

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    "plain": ("plain", None),
    "mtp1": ("mtp1", None),
    "dspark-static": ("dspark", "static"),
    "dspark-sync": ("dspark", "sync"),
    "dspark-async": ("dspark", "async"),
}
COUNTS = ("requests", "failures", "missing_usage", "completed_in_window", "output_tokens")


def start_servers(names: list[str], dtype: str, log_dir: Path) -> dict:
    from sglang_dspark import embedded
    from sglang_dspark.server import SGLangServer, free_port

    paths = embedded.ensure(dtype=dtype)
    servers = {}
    for name in names:
        arm, scheduler = ARMS[name]
        port = free_port()
        env = embedded.launch_env(scheduler=scheduler)
        if scheduler is None:  # plain and MTP-1: no DSPARK scheduler setting at all
            env.pop("SGLANG_DSPARK_SCHEDULER", None)
        servers[name] = SGLangServer(
            cmd=embedded.launch_command(paths, port=port, dtype=dtype, arm=arm),
            env=env, port=port, log_path=log_dir / f"{name}.log",
        )  # fmt: skip
    for name, server in servers.items():  # start one by one: start-up is CPU-bound
        print(f"starting {name} (log {server.log_path}) ...", flush=True)
        server.start()
    return servers


def run_stage(server, name: str, users: int, args, out: Path) -> dict:
    env = dict(
        os.environ, SLA_USERS=str(users), SLA_STAGE_SECONDS=str(args.stage_seconds),
        SLA_MAX_TOKENS=str(args.max_tokens), SLA_IGNORE_EOS="1",
        SLA_TEMPERATURE=str(args.temperature), SLA_LABEL=name, SLA_OUTPUT_DIR=str(out),
    )  # fmt: skip
    locust = Path(sys.executable).with_name("locust")
    cmd = [str(locust), "-f", str(REPO / "loadtest" / "sla.py"), "--headless",
           "--host", server.base_url, "--only-summary"]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{out.name}.locust.log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    report = json.loads((out / "sla_summary.json").read_text())
    if proc.returncode != 0:
        print(f"  {name} c={users}: load test reported {report.get('problems')}", flush=True)
    return report


def merge(reports: list[dict]) -> dict:
    """One arm: its stage rows from every level, rounds averaged per level (counts summed)."""
    by_users: dict[int, list[dict]] = {}
    for rep in reports:
        for row in rep["stages"]:
            by_users.setdefault(int(row["users"]), []).append(row)
    rows = []
    for users in sorted(by_users):
        parts = by_users[users]
        row = dict(parts[0])
        for key, value in parts[0].items():
            if key in COUNTS:
                row[key] = sum(p[key] for p in parts)
            elif isinstance(value, float) or value is None:
                vals = [p[key] for p in parts if isinstance(p.get(key), (int, float))]
                row[key] = fmean(vals) if vals else None
        row["rounds"] = {
            "output_tok_s_total": [p["output_tok_s_total"] for p in parts],
            "user_tok_s_mean": [p["user_tok_s_mean"] for p in parts],
        }
        rows.append(row)
    merged = {k: v for k, v in reports[0].items() if k not in ("stages", "samples")}
    merged["stages"] = rows
    merged["problems"] = sorted({p for r in reports for p in r.get("problems", [])})
    return merged


def table(arms: dict[str, dict]) -> str:
    head = ("| arm | users | tok/s/user | aggregate tok/s | accept len | verify len | TTFT p50 s "
            "| TPOT p50 ms | client CPU |")  # fmt: skip
    lines = [head, "|" + " --- |" * 9]
    f = lambda v, spec: "-" if v is None else format(v, spec)
    for name, rep in arms.items():
        for r in rep["stages"]:
            lines.append(
                f"| {name} | {r['users']} | {f(r['user_tok_s_mean'], '.2f')} | "
                f"{f(r['output_tok_s_total'], '.2f')} | {f(r['accept_len'], '.2f')} | "
                f"{f(r['verify_len_mean'], '.2f')} | {f(r['ttft_p50_s'], '.2f')} | "
                f"{f(None if r['tpot_p50_s'] is None else 1000 * r['tpot_p50_s'], '.0f')} | "
                f"{f(r.get('client_cpu_share'), '.0%')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated, from " + ", ".join(ARMS)
    )
    parser.add_argument("--users", default="1,2,4,8,16", help="concurrency levels")
    parser.add_argument("--stage-seconds", type=float, default=40.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--max-tokens", type=int, default=128, help="every request generates this many (ignore_eos)"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--baseline", default="mtp1")
    parser.add_argument("--arm", default="dspark-sync")
    args = parser.parse_args(argv)

    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in names if a not in ARMS]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    levels = [int(u) for u in args.users.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="pareto-cpu-"))
    servers = start_servers(names, args.dtype, log_dir)
    reports: dict[str, list[dict]] = {n: [] for n in names}
    t0 = time.monotonic()
    try:
        for r in range(args.rounds):
            for i, users in enumerate(levels):
                k = (i + r) % len(names)
                for name in names[k:] + names[:k]:  # rotate who goes first
                    out = args.out / "raw" / name / f"u{users}-r{r}"
                    rep = run_stage(servers[name], name, users, args, out)
                    row = rep["stages"][0]
                    reports[name].append(rep)
                    print(f"[{(time.monotonic() - t0) / 60:5.1f} min] round {r} c={users:<3} "
                          f"{name:<14} {row['output_tok_s_total'] or 0:7.2f} tok/s total, "
                          f"{row['user_tok_s_mean'] or 0:6.2f} tok/s/user", flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    arms = {}
    for name in names:
        arms[name] = merge(reports[name])
        d = args.out / "arms" / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "sla_summary.json").write_text(json.dumps(arms[name], indent=1) + "\n")

    from sglang_dspark.pareto import render, run_pareto

    arm = args.arm if args.arm in names else None
    base = args.baseline if args.baseline in names else None
    result = run_pareto([args.out / "arms" / n / "sla_summary.json" for n in names], args.out,
                        arm=arm, baseline=base)  # fmt: skip
    cmd = "python benchmarks/pareto_cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = f"# Pareto on the embedded CPU default\n\n`{cmd}`\n\n{table(arms)}\n\n```\n{render(result)}\n```\n"
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
