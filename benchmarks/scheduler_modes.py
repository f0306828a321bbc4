#!/usr/bin/env python3
"""Confidence-scheduled verification on the embedded CPU server: the paper's Figure 8 shape.

    python benchmarks/scheduler_modes.py --out docs/scheduler-cpu [--users 1,2,4,8,16]
        [--stage-seconds 35] [--max-tokens 128] [--modes static,sync,async]

One DSPARK server per `SGLANG_DSPARK_SCHEDULER` mode (same drafter, STS calibration and SPS
table, profiled at start-up and cached), all started at once with `--sleep-on-idle` (an idle
one takes no CPU). For each concurrency level every mode serves one `locust -f loadtest/sla.py`
stage in turn, the order rotated from level to level, so the drift of a shared machine falls on
every mode alike (`benchmarks/pareto_cpu.py`'s stages). Greedy, packaged eval prompts, a fixed
number of output tokens per request (`ignore_eos`).

Per mode and level: aggregate output tok/s, tok/s per user, accept length (tokens per verify
round, bonus included) and the mean verify window per request (SGLang's `spec_cap_length`:
1 + the drafts verified; static is gamma + 1 by construction). Writes `report.md` (the table,
each mode's throughput over static), `verify_window.png` (verify window per request and
throughput against concurrency: Figure 8's shape) and `scheduler_modes.json`. Not a test:
speeds depend on the machine; the ratios are measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

MODES = ["static", "sync", "async"]


def _row(rep: dict) -> dict:
    r = rep["stages"][0]
    return {
        "users": int(r["users"]),
        "tok_s": r["output_tok_s_total"],
        "tok_s_per_user": r["user_tok_s_mean"],
        "accept_len": r["accept_len"],
        "verify_window": r["verify_len_mean"],
        "requests": r["requests"],
        "tpot_p50_ms": None if r["tpot_p50_s"] is None else 1000 * r["tpot_p50_s"],
    }


def report_table(rows: dict[str, list[dict]], gamma_plus_one: int) -> str:
    modes = list(rows)
    head = "| users | " + " | ".join(f"{m}: tok/s, per user, accept, window" for m in modes)
    head += " | " + " | ".join(f"{m} / static" for m in modes if m != "static") + " |"
    lines = [head, "|" + " --- |" * (1 + len(modes) + len([m for m in modes if m != "static"]))]
    f = lambda v, spec: "-" if v is None else format(v, spec)
    for i, base in enumerate(rows[modes[0]]):
        cells = []
        for m in modes:
            r = rows[m][i]
            window = r["verify_window"] if m != "static" else float(gamma_plus_one)
            cells.append(
                f"{f(r['tok_s'], '.1f')}, {f(r['tok_s_per_user'], '.1f')}, "
                f"{f(r['accept_len'], '.2f')}, {f(window, '.2f')}"
            )
        ratios = []
        if "static" in rows:
            s = rows["static"][i]["tok_s"]
            for m in modes:
                if m != "static":
                    t = rows[m][i]["tok_s"]
                    ratios.append(f(t / s if t and s else None, ".2f") + "x")
        lines.append(f"| {base['users']} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def plot(rows: dict[str, list[dict]], gamma_plus_one: int, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.0))
    for m, rs in rows.items():
        users = [r["users"] for r in rs]
        window = [gamma_plus_one if m == "static" else r["verify_window"] for r in rs]
        a1.plot(users, window, marker="o", label=m)
        a2.plot(users, [r["tok_s"] for r in rs], marker="o", label=m)
    a1.set_ylabel("verify window per request (tokens, anchor included)")
    a1.set_title("verify window vs concurrency")
    a2.set_ylabel("aggregate output tok/s")
    a2.set_title("throughput vs concurrency")
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xlabel("concurrent users")
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    a1.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--users", default="1,2,4,8,16", help="concurrency levels")
    parser.add_argument("--stage-seconds", type=float, default=35.0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)

    from pareto_cpu import run_stage, start_servers

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    levels = [int(u) for u in args.users.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="scheduler-modes-"))
    servers = start_servers([f"dspark-{m}" for m in modes], args.dtype, log_dir)
    rows: dict[str, list[dict]] = {m: [] for m in modes}
    t0 = time.monotonic()
    try:
        for i, users in enumerate(levels):
            k = i % len(modes)
            for m in modes[k:] + modes[:k]:  # rotate who goes first
                out = args.out / "raw" / m / f"u{users}"
                row = _row(run_stage(servers[f"dspark-{m}"], m, users, args, out))
                rows[m].append(row)
                print(
                    f"[{(time.monotonic() - t0) / 60:5.1f} min] c={users:<3} {m:<7} "
                    f"{row['tok_s'] or 0:7.2f} tok/s, {row['tok_s_per_user'] or 0:6.2f} /user, "
                    f"accept {row['accept_len'] or 0:.2f}, window {row['verify_window'] or 0:.2f}",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
    for m in modes:  # the order levels ran in is not the order of the table
        rows[m].sort(key=lambda r: r["users"])

    from sglang_dspark import embedded

    draft_config = embedded.ensure(dtype=args.dtype).draft / "config.json"
    gamma_plus_one = int(json.loads(draft_config.read_text())["block_size"]) + 1
    (args.out / "scheduler_modes.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "modes": rows}, indent=1)
    )
    png = plot(rows, gamma_plus_one, args.out / "verify_window.png")
    cmd = "python benchmarks/scheduler_modes.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    text = (
        f"# Scheduler modes on the embedded CPU server\n\n`{cmd}`\n\n"
        "Cells: aggregate output tok/s, tok/s per user, accept length (tokens per verify round, "
        "bonus included), mean verify window per request (tokens, anchor included; static "
        f"verifies all {gamma_plus_one}).\n\n{report_table(rows, gamma_plus_one)}\n\n"
        f"![verify window and throughput against concurrency]({png.name})\n"
    )
    (args.out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
