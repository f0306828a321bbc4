"""Paired comparison of drafters: the same prompts, seeds and settings for each, one table.

    sglang-dspark compare --target DIR --draft shipped=DIR --draft new=DIR --out DIR \\
        [--limit 20] [--max-new-tokens 256] [--temperatures 1,0] [--server]

Each drafter (DSpark or an MTP-1 draft) runs the offline evaluator on the same prompts with
the same per-prompt seeds (`runner.prompt_seed`).
tau is tokens per verify round, bonus included, over the full block (no scheduler).
Temperature 1 is the headline (the paper's), temperature 0 beside it.

The ratio of each drafter's tau to the first one's comes with a paired bootstrap 95% interval
over prompts (the same resampled prompts for both, pooled tau = (accepted + rounds) / rounds),
so two drafters can be told apart on one run: an interval that holds 1.0 is a tie.

`--server` also serves every drafter with SGLang on CPU (the embedded default's launch, the
`static` scheduler so that the whole block is verified) and reports the server's tau on the
same prompts: (completion tokens - 1) / verify rounds, pooled;
`--server-url NAME=URL` measures a server that already serves drafter NAME (then its own
scheduler decides how much is verified).

Nothing is lost on interruption: each drafter's per-prompt rounds go to
`OUT/<name>/records.json` with a key of everything they depend on (the draft's files by
sha256, the target, the prompts' token ids, limit, tokens, temperatures, seed, dtype); a rerun
with the same key reuses them instead of evaluating that drafter again.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from sglang_dspark.evaluation.benchmarks import (
    DEFAULT_BENCHMARKS,
    default_eval_dir,
    load_prompts,
)
from sglang_dspark.evaluation.metrics import DEFAULT_THRESHOLDS, RunRecord, build_results
from sglang_dspark.evaluation.report import write_outputs
from sglang_dspark.serving.client import chat_prompt_ids

logger = logging.getLogger(__name__)

BOOTSTRAP_RESAMPLES = 2000
ALL = "all"


@dataclasses.dataclass
class Arm:
    name: str
    path: Path


def parse_arm(text: str) -> Arm:
    """NAME=DIR, or DIR (named after the directory)."""
    name, sep, path = text.partition("=")
    if not sep:
        name, path = Path(text).name, text
    if not name or not path:
        raise ValueError(f"--draft {text!r}: expected NAME=DIR, e.g. shipped=path/to/draft")
    return Arm(name, Path(path))


def parse_url(text: str) -> tuple[str, str]:
    """NAME=URL of a server already serving drafter NAME."""
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith(("http://", "https://")):
        raise ValueError(f"--server-url {text!r}: expected NAME=http://HOST:PORT")
    return name, url.rstrip("/")


# ---------------------------------------------------------------------------- maths
def pooled_tau(accepted: np.ndarray, rounds: np.ndarray) -> float:
    r = float(rounds.sum())
    return (float(accepted.sum()) + r) / r if r > 0 else float("nan")


def paired_ratio(
    a: tuple[np.ndarray, np.ndarray],
    b: tuple[np.ndarray, np.ndarray],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> dict[str, float]:
    """tau_b / tau_a with a paired percentile-bootstrap 95% interval over prompts.

    a, b: (accepted drafts per prompt, verify rounds per prompt), aligned on the prompt."""
    (acc_a, rnd_a), (acc_b, rnd_b) = a, b
    n = len(acc_a)
    if n != len(acc_b):
        raise ValueError(f"unpaired: {n} prompts against {len(acc_b)}")
    ratio = pooled_tau(acc_b, rnd_b) / pooled_tau(acc_a, rnd_a)
    if n < 2:
        return {"ratio": ratio, "low": float("nan"), "high": float("nan")}
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    ra, rb = rnd_a[idx].sum(1), rnd_b[idx].sum(1)
    ta = (acc_a[idx].sum(1) + ra) / np.maximum(ra, 1)
    tb = (acc_b[idx].sum(1) + rb) / np.maximum(rb, 1)
    low, high = np.percentile(tb / ta, [2.5, 97.5])
    return {"ratio": float(ratio), "low": float(low), "high": float(high)}


def per_prompt(records: Sequence[RunRecord], temperature: float, benchmark: str | None):
    """(accepted, rounds) per prompt at one temperature, one benchmark or all (in order)."""
    acc: list[int] = []
    rnd: list[int] = []
    for r in records:
        if r.temperature == temperature and benchmark in (None, r.benchmark):
            acc += [a for a, _ in r.per_prompt]
            rnd += [n for _, n in r.per_prompt]
    return np.array(acc, dtype=np.int64), np.array(rnd, dtype=np.int64)


def run_key(draft: Path, target: Path, prompts: dict[str, list], settings: dict) -> str:
    """Everything a drafter's evaluation depends on, hashed."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(draft).iterdir() if p.is_file()):
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    raw = {"draft": h.hexdigest(), "target": str(Path(target).resolve()),
           "prompts": {b: [list(map(int, ids)) for ids in v] for b, v in prompts.items()},
           **settings}  # fmt: skip
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()


def save_records(path: Path, key: str, records: Sequence[RunRecord]) -> None:
    rows = [{"benchmark": r.benchmark, "temperature": r.temperature,
             "per_prompt": [list(x) for x in r.per_prompt]} for r in records]  # fmt: skip
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"key": key, "records": rows}) + "\n")
    tmp.replace(path)


def load_records(path: Path, key: str) -> list[RunRecord] | None:
    """The saved per-prompt rounds if they were made with this key, else None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if data.get("key") != key:
        return None
    return [
        RunRecord(
            r["benchmark"],
            float(r["temperature"]),
            prompts=len(r["per_prompt"]),
            per_prompt=[(int(a), int(n)) for a, n in r["per_prompt"]],
        )
        for r in data["records"]
    ]


def comparison_table(
    arms: dict[str, list[RunRecord]],
    temperatures: Sequence[float],
    benchmarks: Sequence[str],
    server: dict[str, dict[str, dict[str, float | None]]] | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per (temperature, benchmark or "all"): tau per arm, ratio to the first arm."""
    names = list(arms)
    rows = []
    for temp in temperatures:
        for bench in [*benchmarks, ALL]:
            key = None if bench == ALL else bench
            cells = {n: per_prompt(arms[n], temp, key) for n in names}
            row: dict[str, Any] = {
                "temperature": temp,
                "benchmark": bench,
                "prompts": len(cells[names[0]][0]),
                "tau": {n: pooled_tau(*cells[n]) for n in names},
                "ratio": {n: paired_ratio(cells[names[0]], cells[n], seed=seed) for n in names[1:]},
            }
            if server is not None:
                row["server_tau"] = {n: server.get(n, {}).get(f"{temp:g}", {}).get(bench)
                                     for n in names}  # fmt: skip
            rows.append(row)
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The table as Markdown."""
    if not rows:
        return ""
    names = list(rows[0]["tau"])
    server = "server_tau" in rows[0]
    head = ["T", "benchmark", "prompts", *[f"tau {n}" for n in names]]
    head += [f"{n} / {names[0]} [95% CI]" for n in names[1:]]
    if server:
        head += [f"server tau {n}" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['temperature']:g}", r["benchmark"], str(r["prompts"])]
        cells += [f"{r['tau'][n]:.3f}" for n in names]
        cells += [
            f"{q['ratio']:.3f} [{q['low']:.3f}, {q['high']:.3f}]"
            for q in (r["ratio"][n] for n in names[1:])
        ]
        if server:
            cells += ["-" if r["server_tau"][n] is None else f"{r['server_tau'][n]:.3f}"
                      for n in names]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_table(rows: Sequence[dict[str, Any]], path: Path) -> Path:
    """Grouped bars: tau per benchmark and arm, one panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows[0]["tau"])
    temps = list(dict.fromkeys(r["temperature"] for r in rows))
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    width = 0.8 / len(names)
    for ax, temp in zip(axes[0], temps, strict=True):
        at = [r for r in rows if r["temperature"] == temp]
        x = np.arange(len(at))
        for i, n in enumerate(names):
            ax.bar(x + i * width, [r["tau"][n] for r in at], width, label=n)
        ax.set_xticks(x + width * (len(names) - 1) / 2, [r["benchmark"] for r in at])
        ax.set(title=f"T = {temp:g}", ylabel="tau (tokens per round)")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- serving
SERVER_CONCURRENCY = 8


def served_tau(
    base_url: str,
    prompts: dict[str, list[list[int]]],
    temperatures: Sequence[float],
    max_new_tokens: int,
) -> dict[str, dict[str, float | None]]:
    """tau measured by a running SGLang server on the same prompts: (completion tokens - 1)
    / verify rounds, pooled per benchmark and overall, per T. SGLang seeds sampling per
    request only in deterministic-inference mode, so at T > 0 the draws are the server's own.

    None where the server reports no verify rounds (it does not speculate)."""
    from sglang_dspark.serving.client import generate_ids

    out: dict[str, dict[str, float | None]] = {}
    for temp in temperatures:
        cell: dict[str, float | None] = {}
        total = [0, 0]
        for bench, ids in prompts.items():
            with ThreadPoolExecutor(SERVER_CONCURRENCY) as pool:
                futures = [
                    pool.submit(generate_ids, base_url, p, max_new_tokens=max_new_tokens,
                                temperature=temp)
                    for p in ids
                ]  # fmt: skip
                metas = [f.result()["meta_info"] for f in futures]
            tokens = sum(int(m["completion_tokens"]) - 1 for m in metas)
            rounds = sum(int(m.get("spec_verify_ct") or 0) for m in metas)
            cell[bench] = tokens / rounds if rounds else None
            total = [total[0] + tokens, total[1] + rounds]
        cell[ALL] = total[0] / total[1] if total[1] else None
        out[f"{temp:g}"] = cell
    return out


def start_server(target: Path, arm: Arm, log_dir: Path):
    """The embedded CPU launch serving this drafter: DSPARK with the static scheduler (the
    whole block verified: the drafter's tau, not the scheduler's), or the MTP-1 arm."""
    from sglang_dspark.evaluation.runner import is_mtp_draft
    from sglang_dspark.serving.embedded import EmbeddedPaths, launch_command, launch_env
    from sglang_dspark.serving.server import SGLangServer, free_port

    mtp = is_mtp_draft(arm.path)
    paths = EmbeddedPaths(target, arm.path, True, arm.path, True)
    port = free_port()
    cmd = launch_command(paths, port=port, arm="mtp1" if mtp else "dspark")
    env = launch_env(scheduler=None if mtp else "static")
    return SGLangServer(cmd, env, port, log_dir / f"server-{arm.name}.log")


# ---------------------------------------------------------------------------- the run
def run_comparison(args: argparse.Namespace) -> dict[str, Path]:
    from transformers import AutoTokenizer

    from sglang_dspark.evaluation.runner import eos_ids, evaluate, load_models

    arms = [parse_arm(a) for a in args.draft]
    if len({a.name for a in arms}) != len(arms):
        raise ValueError(f"--draft names must differ, got {[a.name for a in arms]}")
    for a in arms:
        if not (a.path / "config.json").is_file():
            raise FileNotFoundError(
                f"--draft {a.name}={a.path}: no config.json there; pass a draft directory "
                "(SGLang format, e.g. an `sglang-dspark export` output)."
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    eval_dir = Path(args.eval_dir) if args.eval_dir else default_eval_dir()
    texts = {b: load_prompts(eval_dir, b, args.limit) for b in args.benchmarks}
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = {b: [chat_prompt_ids(tokenizer, t) for t in ts] for b, ts in texts.items()}
    eos = eos_ids(args.target, tokenizer)

    records: dict[str, list[RunRecord]] = {}
    settings = {"limit": args.limit, "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                "dtype": args.dtype, "temperatures": list(args.temperatures)}  # fmt: skip
    for arm in arms:
        key = run_key(arm.path, Path(args.target), prompts, settings)
        saved = out / arm.name / "records.json"
        reused = load_records(saved, key)
        if reused is not None:
            logger.info("drafter %s: reusing %s (same drafter, prompts and settings)",
                        arm.name, saved)  # fmt: skip
            records[arm.name] = reused
            continue
        logger.info("drafter %s (%s)", arm.name, arm.path)
        target, proposer = load_models(args.target, arm.path, dtype=args.dtype)
        recs = evaluate(
            target, proposer, prompts, temperatures=args.temperatures,
            max_new_tokens=args.max_new_tokens, seed=args.seed, eos_token_ids=eos,
            progress=args.progress,
        )  # fmt: skip
        config = {"draft": str(arm.path), "name": arm.name, "limit": args.limit,
                  "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                  "dtype": args.dtype, "eval_dir": str(eval_dir)}  # fmt: skip
        results = build_results(recs, proposer.gamma, DEFAULT_THRESHOLDS, config)
        write_outputs(recs, results, out / arm.name)
        save_records(saved, key, recs)
        records[arm.name] = recs
        del target, proposer
        gc.collect()

    urls = dict(parse_url(u) for u in args.server_url or [])
    unknown = set(urls) - {a.name for a in arms}
    if unknown:
        raise ValueError(f"--server-url names {sorted(unknown)}, which no --draft names")
    server = None
    if args.server or urls:
        server = {}
        for a in arms:
            if a.name in urls:
                server[a.name] = served_tau(
                    urls[a.name], prompts, args.temperatures, args.max_new_tokens
                )
            elif args.server:
                with start_server(Path(args.target), a, out) as srv:
                    server[a.name] = served_tau(
                        srv.base_url, prompts, args.temperatures, args.max_new_tokens
                    )
    rows = comparison_table(records, args.temperatures, args.benchmarks, server, args.seed)
    table = format_table(rows)
    summary = {
        "target": str(args.target),
        "drafters": {a.name: str(a.path) for a in arms},
        "benchmarks": list(args.benchmarks),
        "limit": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "temperatures": list(args.temperatures),
        "seed": args.seed,
        "dtype": args.dtype,
        "bootstrap_resamples": BOOTSTRAP_RESAMPLES,
        "rows": rows,
    }
    paths = {
        "json": out / "comparison.json",
        "markdown": out / "comparison.md",
        "plot": out / "comparison.png",
    }
    paths["json"].write_text(json.dumps(summary, indent=2) + "\n")
    paths["markdown"].write_text(table + "\n")
    plot_table(rows, paths["plot"])
    print(table)
    return paths


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sglang_dspark.evaluation.runner import _floats, _names

    parser.add_argument("--target", required=True, help="target model directory (HF format)")
    parser.add_argument(
        "--draft", action="append", required=True, metavar="NAME=DIR",
        help="a drafter to compare (repeat; the first is the reference of the ratios)",
    )  # fmt: skip
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--benchmarks", type=_names, default=list(DEFAULT_BENCHMARKS))
    parser.add_argument("--eval-dir", default=None, help="benchmark folder (default: packaged)")
    parser.add_argument("--limit", type=int, default=20, help="prompts per benchmark (20)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--temperatures", "--temperature", dest="temperatures", type=_floats, default=[1.0, 0.0],
        help="comma-separated (default 1,0: the paper's headline first)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--server", action="store_true",
        help="also serve each drafter with SGLang on CPU (static scheduler) and report its tau",
    )  # fmt: skip
    parser.add_argument(
        "--server-url", action="append", metavar="NAME=URL",
        help="a running server for drafter NAME: its tau on the same prompts (repeat)",
    )  # fmt: skip
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def run(args: argparse.Namespace) -> int:
    if len(args.draft) < 1:
        raise ValueError("name at least one --draft")
    if args.limit <= 0 or args.max_new_tokens <= 0:
        raise ValueError("--limit and --max-new-tokens must be positive")
    if not args.temperatures or any(t < 0 for t in args.temperatures):
        raise ValueError(f"--temperatures must be >= 0, got {args.temperatures}")
    paths = run_comparison(args)
    print(paths["markdown"])
    return 0
