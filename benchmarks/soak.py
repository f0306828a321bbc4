#!/usr/bin/env python3
"""Soak: the embedded DSPARK server at saturation for minutes, memory of every process sampled.

    python benchmarks/soak.py --minutes 10 --users 16 --out docs/soak

Starts the embedded default (`sglang-dspark embedded --print-command` shows it), runs one
`locust -f loadtest/sla.py` stage of `--users` concurrent streaming users for `--minutes`, and
samples the resident set size (VmRSS) of every process of the server's process group every
`--every` seconds. Writes `soak.json` (samples, the load test's stage row, verdict),
`soak.png` (RSS per process over time) and the load test's own summary under `sla/`.

Verdict: 0 failed requests, and memory bounded: over the second half of the run (after warm-up
and the KV cache filling), no process grows by more than `--max-growth-mb` (least-squares slope
x duration of that half). Exit code 1 when either fails.
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

REPO = Path(__file__).resolve().parents[1]


def rss_by_process(pgid: int) -> dict[str, float]:
    """VmRSS in MB of every live process in the group, keyed 'pid name'."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            name = fields["Name"].strip()
            out[f"{pid} {name}"] = int(fields["VmRSS"].split()[0]) / 1024
        except (OSError, ProcessLookupError, KeyError, ValueError):
            continue
    return out


def slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope dy/dt."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


def growth(samples: list[dict]) -> dict[str, float]:
    """Per process: fitted MB of growth over the second half of the run."""
    half = samples[len(samples) // 2 :]
    if len(half) < 2:
        return {}
    span = half[-1]["t"] - half[0]["t"]
    names = set().union(*(s["rss_mb"] for s in half))
    out = {}
    for name in sorted(names):
        pts = [(s["t"], s["rss_mb"][name]) for s in half if name in s["rss_mb"]]
        out[name] = slope([t for t, _ in pts], [y for _, y in pts]) * span
    return out


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = sorted(set().union(*(s["rss_mb"] for s in samples)))
    for name in names:
        pts = [(s["t"] / 60, s["rss_mb"][name]) for s in samples if name in s["rss_mb"]]
        if max(y for _, y in pts) > 50:  # leave out helper processes of a few MB
            ax.plot([t for t, _ in pts], [y for _, y in pts], label=name)
    total = [(s["t"] / 60, sum(s["rss_mb"].values())) for s in samples]
    ax.plot([t for t, _ in total], [y for _, y in total], "k--", label="all (RSS sum)")
    ax.set_xlabel("minutes at saturation")
    ax.set_ylabel("resident set size (MB)")
    ax.set_title("Embedded DSPARK server under sustained load: memory per process")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--users", type=int, default=16, help="concurrent users (16 = the "
                        "embedded server's --max-running-requests: saturation)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--max-growth-mb", type=float, default=64.0)
    parser.add_argument("--arm", default="dspark", choices=["dspark", "mtp1", "plain"])
    parser.add_argument("--out", type=Path, default=Path("soak"))
    args = parser.parse_args(argv)

    from sglang_dspark import embedded
    from sglang_dspark.server import SGLangServer, free_port

    args.out.mkdir(parents=True, exist_ok=True)
    paths = embedded.ensure()
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"soak-server-{port}.log"
    server = SGLangServer(
        cmd=embedded.launch_command(paths, port=port, arm=args.arm),
        env=embedded.launch_env(), port=port, log_path=log,
    )  # fmt: skip
    print(f"starting the embedded {args.arm} server (log: {log}) ...", flush=True)
    server.start()
    samples: list[dict] = []
    try:
        pgid = os.getpgid(server.proc.pid)
        env = dict(
            os.environ, SLA_USERS=str(args.users), SLA_STAGE_SECONDS=str(args.minutes * 60),
            SLA_MAX_TOKENS=str(args.max_tokens), SLA_TEMPERATURE=str(args.temperature),
            SLA_LABEL=f"soak-{args.arm}", SLA_OUTPUT_DIR=str(args.out / "sla"),
        )  # fmt: skip
        locust = Path(sys.executable).with_name("locust")
        cmd = [str(locust), "-f", str(REPO / "loadtest" / "sla.py"), "--headless",
               "--host", server.base_url, "--only-summary"]  # fmt: skip
        t0 = time.monotonic()
        with open(args.out / "locust.log", "w") as lf:
            proc = subprocess.Popen(cmd, env=env, stdout=lf, stderr=subprocess.STDOUT)
            while proc.poll() is None:
                samples.append({"t": time.monotonic() - t0, "rss_mb": rss_by_process(pgid)})
                print(f"\r{samples[-1]['t'] / 60:5.1f} min, server RSS "
                      f"{sum(samples[-1]['rss_mb'].values()):7.0f} MB", end="", flush=True)  # fmt: skip
                time.sleep(args.every)
        print()
        alive = server.proc.poll() is None
    finally:
        server.stop()
    report = json.loads((args.out / "sla" / "sla_summary.json").read_text())
    stage = report["stages"][0]
    grown = growth(samples)
    worst = max(grown.values(), default=0.0)
    verdict = {
        "failures": stage["failures"],
        "requests": stage["requests"],
        "missing_usage": stage["missing_usage"],
        "server_alive_at_end": alive,
        "max_growth_second_half_mb": round(worst, 1),
        "peak_rss_sum_mb": round(max(sum(s["rss_mb"].values()) for s in samples), 1),
        "passed": stage["failures"] == 0
        and alive
        and worst <= args.max_growth_mb
        and locust_ok(proc.returncode, report),
    }
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "verdict": verdict,
           "growth_second_half_mb": grown, "stage": stage, "samples": samples}  # fmt: skip
    (args.out / "soak.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(samples, args.out / "soak.png")
    print(json.dumps(verdict, indent=1))
    return 0 if verdict["passed"] else 1


def locust_ok(returncode: int, report: dict) -> bool:
    """The load test's own verdict (failed requests, missing usage, drains)."""
    return returncode == 0 and not report.get("problems")


if __name__ == "__main__":
    sys.exit(main())
