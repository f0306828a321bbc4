#!/usr/bin/env python3
"""Soak: the embedded DSPARK server at saturation for minutes, memory of every process sampled.

    python benchmarks/soak.py --minutes 10 --users 16 --out docs/soak

Starts the embedded default (`sglang-dspark embedded --print-command` shows it), runs one
`locust -f loadtest/sla.py` stage of `--users` concurrent streaming users for `--minutes`, and
samples the resident set size (VmRSS) of every process of the server's process group every
`--every` seconds. Writes `soak.json` (samples, the load test's stage row, verdict),
`soak.png` (RSS per process over time) and the load test's own summary under `sla/`.

Verdict: 0 failed requests, and memory bounded: over the second half of the run (after warm-up
and the KV cache filling), no process, nor the sum of all of them, grows by more than
`--max-growth-mb` (least-squares slope x duration of that half). Exit code 1 when either fails.
The fitted growth over the last third is reported beside it (not a criterion): a process that
grew early and then flattened shows about 0 there, a steady climb about two thirds of its
second-half growth. `--env KEY=VALUE` (repeatable) sets a variable of the server's environment
and `--env KEY=` removes one, for paired runs that change one setting: e.g. two soaks at once,
one of them with `--env SGLANG_DSPARK_MALLOC_TRIM_SECONDS=0` (the plugin's heap trimming off,
`sglang_dspark/plugin/cpu_memory.py`). Server CPU seconds per output token are reported too: a
cost that compares between paired runs on a shared machine.
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

from sglang_dspark.serving.server import group_pids

REPO = Path(__file__).resolve().parents[1]


def rss_by_process(pgid: int, field: str = "VmRSS") -> dict[str, float]:
    """VmRSS (or another /proc status field in kB, e.g. RssAnon) in MB of every live process
    in the group, keyed 'pid name'."""
    out = {}
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            name = fields["Name"].strip()
            out[f"{pid} {name}"] = int(fields[field].split()[0]) / 1024
        except (OSError, ProcessLookupError, KeyError, ValueError):
            continue
    return out


def cpu_by_process(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by every live process in the group, same keys."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in group_pids(pgid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1 : stat.rindex(")")][:15]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[f"{pid} {name}"] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        except (OSError, ProcessLookupError, ValueError, IndexError):
            continue
    return out


def cpu_per_token(samples: list[dict], output_tokens: int | None) -> float | None:
    """Server CPU seconds (all processes, first to last sample) per output token of the run's
    requests: a cost that does not depend on how many cores the server got, so that paired runs
    on a shared machine compare."""
    if not output_tokens or len(samples) < 2 or "cpu_s" not in samples[0]:
        return None
    first, last = samples[0]["cpu_s"], samples[-1]["cpu_s"]
    used = sum(last[k] - first[k] for k in last if k in first)
    return used / output_tokens


def slope(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope dy/dt."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else 0.0


SUM = "all (RSS sum)"


def growth(samples: list[dict], tail: float = 0.5, key: str = "rss_mb") -> dict[str, float]:
    """Per process, and for the sum of all (`SUM`): fitted MB of growth over the last `tail`
    fraction of the run (slope x span of that part), of `key` (rss_mb or anon_mb)."""
    part = [s for s in samples[int(len(samples) * (1 - tail)) :] if key in s]  # tail=0.5: n // 2
    if len(part) < 2:
        return {}
    span = part[-1]["t"] - part[0]["t"]
    names = set().union(*(s[key] for s in part))
    out = {}
    for name in sorted(names):
        pts = [(s["t"], s[key][name]) for s in part if name in s[key]]
        out[name] = slope([t for t, _ in pts], [y for _, y in pts]) * span
    out[SUM] = slope([s["t"] for s in part], [sum(s[key].values()) for s in part]) * span
    return out


def rss_summary(samples: list[dict], key: str = "rss_mb") -> dict[str, dict[str, float]]:
    """Per process: RSS (MB) at the first and last sample, minimum and maximum."""
    samples = [s for s in samples if key in s]
    names = sorted(set().union(*(s[key] for s in samples))) if samples else []
    out = {}
    for name in names:
        ys = [s[key][name] for s in samples if name in s[key]]
        out[name] = {"start": round(ys[0], 1), "end": round(ys[-1], 1),
                     "min": round(min(ys), 1), "max": round(max(ys), 1)}  # fmt: skip
    return out


def verdict_of(samples: list[dict], stage: dict | None, *, alive: bool, locust_ok: bool,
               max_growth_mb: float) -> dict:  # fmt: skip
    """The soak's verdict; `stage` None when the load test wrote no summary (a failure).

    Both VmRSS and RssAnon (anonymous memory: heap, tensors, KV pool) must stay within the
    bound. RssAnon is what a leak or a fragmented heap grows, and with no swap the kernel cannot
    take it back, whereas under memory pressure it reclaims file-backed pages (mmapped weights,
    libraries) and VmRSS falls, which could hide a growth."""
    grown = growth(samples)
    anon = growth(samples, key="anon_mb") if all("anon_mb" in s for s in samples) else {}
    worst = max(grown.values(), default=float("inf"))
    worst_anon = max(anon.values(), default=worst)
    third = growth(samples, tail=1 / 3)
    stage = stage or {}
    return {
        "failures": stage.get("failures"),
        "requests": stage.get("requests"),
        "missing_usage": stage.get("missing_usage"),
        "server_alive_at_end": alive,
        "max_growth_second_half_mb": round(worst, 1),
        "max_growth_second_half_anon_mb": round(worst_anon, 1),
        "max_growth_last_third_mb": round(max(third.values(), default=float("inf")), 1),
        "peak_rss_sum_mb": round(max((sum(s["rss_mb"].values()) for s in samples), default=0), 1),
        "passed": bool(stage)
        and stage.get("failures") == 0
        and alive
        and worst <= max_growth_mb
        and worst_anon <= max_growth_mb
        and locust_ok,
    }


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = sorted(set().union(*(s["rss_mb"] for s in samples)))
    for name in names:
        pts = [(s["t"] / 60, s["rss_mb"][name]) for s in samples if name in s["rss_mb"]]
        if max(y for _, y in pts) > 50:  # leave out helper processes of a few MB
            (line,) = ax.plot([t for t, _ in pts], [y for _, y in pts], label=name)
            anon = [(s["t"] / 60, s["anon_mb"][name]) for s in samples
                    if name in s.get("anon_mb", {})]  # fmt: skip
            if anon:
                ax.plot([t for t, _ in anon], [y for _, y in anon], ":", color=line.get_color(),
                        label=f"{name} (anonymous)")  # fmt: skip
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
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set (KEY=VALUE) or remove (KEY=) a variable of the server's "
                        "environment (repeatable), e.g. for a paired run with one setting "
                        "changed")  # fmt: skip
    args = parser.parse_args(argv)
    extra_env = parse_env(args.env, parser)

    from sglang_dspark.serving import embedded
    from sglang_dspark.serving.server import SGLangServer, free_port

    args.out.mkdir(parents=True, exist_ok=True)
    paths = embedded.ensure()
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"soak-server-{port}.log"
    server = SGLangServer(
        cmd=embedded.launch_command(paths, port=port, arm=args.arm),
        env=server_env(embedded.launch_env(), extra_env), port=port, log_path=log,
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
                samples.append({"t": time.monotonic() - t0, "rss_mb": rss_by_process(pgid),
                                "anon_mb": rss_by_process(pgid, "RssAnon"),
                                "cpu_s": cpu_by_process(pgid)})  # fmt: skip
                print(f"\r{samples[-1]['t'] / 60:5.1f} min, server RSS "
                      f"{sum(samples[-1]['rss_mb'].values()):7.0f} MB", end="", flush=True)  # fmt: skip
                time.sleep(args.every)
        print()
        alive = server.proc.poll() is None
    finally:
        server.stop()
    summary = args.out / "sla" / "sla_summary.json"
    report = json.loads(summary.read_text()) if summary.is_file() else {}
    stage = report["stages"][0] if report.get("stages") else None
    verdict = verdict_of(samples, stage, alive=alive, max_growth_mb=args.max_growth_mb,
                         locust_ok=bool(report) and locust_ok(proc.returncode, report))  # fmt: skip
    # Every request's tokens (warm-up and drain included), as the CPU time covers the whole run.
    tokens = sum(r.get("output_tokens") or 0 for r in report.get("samples", []))
    per_token = cpu_per_token(samples, tokens)
    verdict["server_cpu_s_per_output_token"] = None if per_token is None else round(per_token, 4)
    out = {"args": {k: str(v) for k, v in vars(args).items()}, "server_env": extra_env,
           "verdict": verdict, "growth_second_half_mb": growth(samples),
           "growth_last_third_mb": growth(samples, tail=1 / 3), "rss_mb": rss_summary(samples),
           "growth_second_half_anon_mb": growth(samples, key="anon_mb"),
           "anon_mb": rss_summary(samples, key="anon_mb"),
           "stage": stage, "samples": samples}  # fmt: skip
    (args.out / "soak.json").write_text(json.dumps(out, indent=1) + "\n")
    plot(samples, args.out / "soak.png")
    print(json.dumps(verdict, indent=1))
    return 0 if verdict["passed"] else 1


def parse_env(items: list[str], parser: argparse.ArgumentParser | None = None) -> dict[str, str]:
    """`KEY=VALUE` strings as a dict (the value may contain `=`; empty is allowed)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            msg = f"--env expects KEY=VALUE, got {item!r}"
            if parser is not None:
                parser.error(msg)
            raise ValueError(msg)
        out[key] = value
    return out


def server_env(base: dict[str, str], extra: dict[str, str]) -> dict[str, str]:
    """`base` with `extra` applied: an empty value removes the variable."""
    env = dict(base)
    for key, value in extra.items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    return env


def locust_ok(returncode: int, report: dict) -> bool:
    """The load test's own verdict (failed requests, missing usage, drains)."""
    return returncode == 0 and not report.get("problems")


if __name__ == "__main__":
    sys.exit(main())
