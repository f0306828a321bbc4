"""Pareto curves from load-test summaries: the DSpark paper's Figures 7 and 8.

    sglang-dspark pareto runs/no-spec runs/mtp1 runs/dspark-sync --out plots \\
        --arm dspark-sync --baseline mtp1     # or: python -m sglang_dspark.measurement.pareto ...

Each input is an ``sla_summary.json`` written by ``locust -f loadtest/sla.py`` (or a directory
holding one or more); each is one arm, named by its label (``SLA_LABEL``) or ``--label``.
Each stage (concurrency level) of an arm is one point:

- x: tokens/s per user of the stage. ``--x-metric e2e`` (the default, the SLA view): mean over
  requests of tokens / e2e, the time to first token included; ``mean``: mean of 1 / TPOT, the
  streaming speed once the first token arrived; ``p50``: its median;
- y: aggregate output tokens/s of the stage divided by ``--replicas``. ``--y-metric same`` (the
  default): from the same requests as x (``output_tok_s_same``, users x tokens / busy time);
  ``window``: every token generated inside the stage's window (``output_tok_s_total``).

A summary whose stages carry ``rounds`` (one value per interleaved round, as
``benchmarks/serving.py`` writes them) gets 95% confidence intervals on both axes (Student
t over the rounds, drawn as error bars) and, between the two compared arms, the gains
computed round by round (round r of the arm against round r of the baseline: the rounds are
interleaved, so they are paired) with their mean and interval.

Outputs in ``--out``:

- ``pareto.png`` (Figure 7): every arm's points in concurrency order (labelled ``c=N``), its
  Pareto frontier (the points no other point of the arm beats in both x and y), and, between
  ``--arm`` and ``--baseline``, the two gains below;
- ``verify_budget.png`` (Figure 8): the mean verify length per request (SGLang's per-request
  ``spec_cap_length``, anchor included) against concurrency, for the arms that report it; an
  arm with a fixed window that reports none (e.g. MTP-1: ``speculative_num_draft_tokens=2``)
  is drawn as a flat line at its ``num_draft_tokens``;
- ``pareto.csv``: one row per arm and stage; ``pareto.json``: points, frontiers, gains, method.

Gains (`METHOD`): each frontier, sorted by x, is read as a piecewise-linear curve y(x); since
frontier points are mutually non-dominated, y strictly falls as x rises, so the curve is also
a piecewise-linear function x(y). Throughput gain at matched tok/s/user: y_arm(x) / y_base(x)
for x in the overlap of the two frontiers' x ranges; per-user speed gain at matched
throughput: x_arm(y) / x_base(y) over the overlap of their y ranges. Both are evaluated on an
even grid over the overlap plus every frontier point inside it, and at each baseline frontier
point; the reported maximum is exact, because between consecutive breakpoints both curves are
linear and a ratio of linear functions is monotone. No extrapolation: without an overlap
there is no gain.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from sglang_dspark.measurement.loadmetrics import load_report

METHOD = (
    "Frontier: the points of an arm not dominated in both tok/s/user (x) and aggregate output "
    "tok/s per replica (y). Each frontier, sorted by x, is a piecewise-linear curve y(x), "
    "strictly decreasing, hence also a piecewise-linear x(y). Throughput gain at matched "
    "tok/s/user = y_arm(x) / y_baseline(x) over the overlap of the two frontiers' x ranges; "
    "per-user speed gain at matched throughput = x_arm(y) / x_baseline(y) over the overlap of "
    "their y ranges; evaluated on an even grid over the overlap plus every frontier point in "
    "it, and at each baseline frontier point. The maximum is exact (a ratio of two linear "
    "functions is monotone between breakpoints). No extrapolation outside the overlap."
)
X_METRICS = {"e2e": "user_tok_s_e2e_mean", "mean": "user_tok_s_mean", "p50": "user_tok_s_p50"}
Y_METRICS = {"same": "output_tok_s_same", "window": "output_tok_s_total"}
CI_LEVEL = 0.95


def mean_ci(values: Sequence[float], level: float = CI_LEVEL) -> tuple[float, float, float]:
    """(mean, low, high): Student t interval of the mean; one value: (v, v, v)."""
    from scipy import stats

    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("mean_ci of no values")
    m = sum(vals) / len(vals)
    if len(vals) < 2:
        return m, m, m
    half = stats.sem(vals) * stats.t.ppf((1 + level) / 2, len(vals) - 1)
    return m, m - half, m + half


@dataclass(frozen=True)
class Point:
    users: int
    x: float  # tokens/s per user
    y: float  # aggregate output tokens/s per replica
    verify_len: float | None = None
    accept_len: float | None = None
    x_ci: tuple[float, float] | None = None  # 95% interval over rounds
    y_ci: tuple[float, float] | None = None
    rounds: int = 1


@dataclass
class Arm:
    label: str
    points: list[Point]
    algorithm: str | None = None
    num_draft_tokens: int | None = None
    source: str = ""
    # round r's points (the same stages, one round's values); empty without rounds
    round_points: list[list[Point]] = field(default_factory=list)

    @property
    def frontier(self) -> list[Point]:
        return frontier(self.points)


@dataclass
class Gain:
    """A ratio arm / baseline along one axis ("x": matched tok/s/user, "y": matched
    throughput): the maximum, where it is, and its value at each baseline frontier point."""

    matched: str
    overlap: tuple[float, float]
    max_gain: float
    at: float
    arm_value: float  # the arm's value at `at` (y for matched x, x for matched y)
    baseline_value: float
    at_baseline_points: list[dict[str, float]]
    grid: list[tuple[float, float]]


# ------------------------------------------------------------------------------------------
# maths


def dominates(q: Point, p: Point) -> bool:
    """q is at least as good as p in x and y and better in one."""
    return q.x >= p.x and q.y >= p.y and (q.x > p.x or q.y > p.y)


def frontier(points: Sequence[Point]) -> list[Point]:
    """The non-dominated points (duplicates once), sorted by x; their y strictly decreases."""
    out: list[Point] = []
    for p in points:
        if any(dominates(q, p) for q in points):
            continue
        if any(q.x == p.x and q.y == p.y for q in out):
            continue
        out.append(p)
    return sorted(out, key=lambda p: p.x)


def interp_y(front: Sequence[Point], x: float) -> float | None:
    """y on the frontier at x, linear between frontier points; None outside its x range."""
    if not front or x < front[0].x or x > front[-1].x:
        return None
    for a, b in pairwise(front):
        if a.x <= x <= b.x:
            return a.y + (b.y - a.y) * (x - a.x) / (b.x - a.x)
    return front[0].y  # a single point


def interp_x(front: Sequence[Point], y: float) -> float | None:
    """x on the frontier at throughput y (the inverse curve); None outside its y range."""
    if not front or y > front[0].y or y < front[-1].y:
        return None
    for a, b in pairwise(front):
        if b.y <= y <= a.y:
            return a.x + (b.x - a.x) * (y - a.y) / (b.y - a.y)
    return front[0].x


def _grid(lo: float, hi: float, n: int, extra: Sequence[float]) -> list[float]:
    even = [lo] if hi == lo else [lo + (hi - lo) * i / (n - 1) for i in range(n)]
    return sorted({*even, *(v for v in extra if lo <= v <= hi)})


def gain(arm: Sequence[Point], base: Sequence[Point], matched: str, n: int = 201) -> Gain | None:
    """arm / baseline on their frontiers at matched x ("x") or matched y ("y"); None when the
    frontiers do not overlap on that axis. `arm` and `base` are frontiers (see `frontier`)."""
    if not arm or not base:
        return None
    if matched == "x":
        key, value = (lambda p: p.x), interp_y
    elif matched == "y":
        key, value = (lambda p: p.y), interp_x
    else:
        raise ValueError(f"matched must be 'x' or 'y', got {matched!r}")
    lo = max(min(map(key, arm)), min(map(key, base)))
    hi = min(max(map(key, arm)), max(map(key, base)))
    if lo > hi:
        return None
    grid = []
    for v in _grid(lo, hi, n, [key(p) for p in (*arm, *base)]):
        a, b = value(arm, v), value(base, v)
        if a is not None and b:
            grid.append((v, a / b))
    if not grid:
        return None
    at, best = max(grid, key=lambda g: g[1])
    at_base = []
    for p in base:
        a = value(arm, key(p))
        if a is not None:
            base_value = p.y if matched == "x" else p.x
            at_base.append({"users": p.users, "at": key(p), "gain": a / base_value})
    return Gain(
        matched=matched,
        overlap=(lo, hi),
        max_gain=best,
        at=at,
        arm_value=value(arm, at),
        baseline_value=value(base, at),
        at_baseline_points=at_base,
        grid=grid,
    )


# ------------------------------------------------------------------------------------------
# input


def find_summaries(paths: Sequence[str | Path]) -> list[Path]:
    """Files as given; a directory: every sla_summary.json under it (sorted)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.rglob("sla_summary.json"))
            if not found:
                raise FileNotFoundError(
                    f"no sla_summary.json under {p}: point at the SLA_OUTPUT_DIR of a "
                    "`locust -f loadtest/sla.py` run"
                )
            out += found
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"{p} does not exist (expected sla_summary.json or its dir)")
    return out


def arm_from_report(
    report: dict[str, Any],
    label: str | None = None,
    replicas: float = 1.0,
    x_metric: str = "e2e",
    source: str = "",
    y_metric: str = "same",
) -> Arm:
    """One arm from a summary: one point per stage with a measured x and y."""
    if replicas <= 0:
        raise ValueError(f"--replicas must be > 0, got {replicas}")
    xk, yk = X_METRICS[x_metric], Y_METRICS[y_metric]
    points = []
    per_round: dict[int, list[Point]] = {}
    for row in report["stages"]:
        for key, flag, name in ((xk, "--x-metric", x_metric), (yk, "--y-metric", y_metric)):
            if key not in row:
                raise ValueError(
                    f"{source or 'summary'}: stage c={row.get('users')} has no {key} "
                    f"({flag} {name}); summaries written before it existed need "
                    "--x-metric mean --y-metric window"
                )
        x, y = row.get(xk), row.get(yk)
        if x is None or y is None or x <= 0 or y <= 0:
            continue
        rounds = row.get("rounds") or {}
        xs, ys = rounds.get(xk) or [], rounds.get(yk) or []
        paired = len(xs) == len(ys) >= 2 and None not in xs and None not in ys
        users = int(row["users"])
        if paired:
            _, xlo, xhi = mean_ci(xs)
            _, ylo, yhi = mean_ci([v / replicas for v in ys])
            for r, (xr, yr) in enumerate(zip(xs, ys, strict=True)):
                per_round.setdefault(r, []).append(Point(users, float(xr), float(yr) / replicas))
        points.append(
            Point(
                users=users,
                x=float(x),
                y=float(y) / replicas,
                verify_len=row.get("verify_len_mean"),
                accept_len=row.get("accept_len"),
                x_ci=(xlo, xhi) if paired else None,
                y_ci=(ylo, yhi) if paired else None,
                rounds=len(xs) if paired else 1,
            )
        )
    server = report.get("server") or {}
    complete = [per_round[r] for r in sorted(per_round) if len(per_round[r]) == len(points)]
    return Arm(
        label=label or report.get("label") or Path(source).parent.name or "arm",
        points=points,
        algorithm=server.get("speculative_algorithm"),
        num_draft_tokens=server.get("speculative_num_draft_tokens"),
        source=source,
        round_points=complete if len(complete) >= 2 else [],
    )


def load_arms(
    paths: Sequence[str | Path],
    labels: Sequence[str] = (),
    replicas: float = 1.0,
    x_metric: str = "e2e",
    y_metric: str = "same",
) -> list[Arm]:
    files = find_summaries(paths)
    if labels and len(labels) != len(files):
        raise ValueError(
            f"{len(labels)} --label for {len(files)} summaries ({', '.join(map(str, files))}): "
            "give one --label per summary, in order, or none"
        )
    arms = [
        arm_from_report(
            load_report(f), labels[i] if labels else None, replicas, x_metric, str(f), y_metric
        )
        for i, f in enumerate(files)
    ]
    seen: dict[str, str] = {}
    for a in arms:
        if a.label in seen:
            raise ValueError(
                f"two summaries are labelled {a.label!r} ({seen[a.label]}, {a.source}): "
                "set SLA_LABEL when running, or pass --label per summary"
            )
        seen[a.label] = a.source
    return arms


def pick(arms: Sequence[Arm], arm: str | None, baseline: str | None) -> tuple[Arm, Arm] | None:
    """The compared pair: the named ones; unnamed, the DSPARK arm against the first other
    speculative arm (MTP), else against the first non-speculative one."""
    by_label = {a.label: a for a in arms}
    for name in (arm, baseline):
        if name is not None and name not in by_label:
            raise ValueError(f"no arm labelled {name!r}; the arms are {sorted(by_label)}")
    chosen = by_label[arm] if arm else None
    if chosen is None:
        chosen = next((a for a in arms if (a.algorithm or "").upper() == "DSPARK"), None)
    if chosen is None:
        return None
    if baseline:
        return chosen, by_label[baseline]
    others = [a for a in arms if a is not chosen]
    base = next((a for a in others if a.algorithm and a.algorithm.upper() != "DSPARK"), None)
    base = base or next((a for a in others if not a.algorithm), None)
    return (chosen, base) if base else None


# ------------------------------------------------------------------------------------------
# output


def compare(arm: Arm, base: Arm, n: int = 201) -> dict[str, Any]:
    out: dict[str, Any] = {"arm": arm.label, "baseline": base.label}
    for name, matched in (
        ("throughput_gain_at_matched_user_tok_s", "x"),
        ("user_speed_gain_at_matched_throughput", "y"),
    ):
        g = gain(arm.frontier, base.frontier, matched, n)
        out[name] = None if g is None else asdict(g)
    rounds = compare_rounds(arm, base, n)
    if rounds:
        out["rounds"] = rounds
    return out


def compare_rounds(arm: Arm, base: Arm, n: int = 201) -> dict[str, Any] | None:
    """The gains round by round (round r of the arm against round r of the baseline), each
    round's maximum and minimum over its overlap, with their means and 95% intervals."""
    k = min(len(arm.round_points), len(base.round_points))
    if k < 2:
        return None
    out: dict[str, Any] = {"rounds": k, "level": CI_LEVEL}
    for name, matched in (
        ("throughput_gain_at_matched_user_tok_s", "x"),
        ("user_speed_gain_at_matched_throughput", "y"),
    ):
        maxima, minima = [], []
        for r in range(k):
            g = gain(frontier(arm.round_points[r]), frontier(base.round_points[r]), matched, n)
            if g is not None:
                maxima.append(g.max_gain)
                minima.append(min(v for _, v in g.grid))
        entry: dict[str, Any] = {"rounds_with_overlap": len(maxima)}
        for key, vals in (("max", maxima), ("min", minima)):
            if vals:
                m, lo, hi = mean_ci(vals)
                entry[key] = {"mean": m, "ci": [lo, hi], "per_round": vals}
        out[name] = entry
    return out


def write_csv(arms: Sequence[Arm], path: Path) -> None:
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(
            [
                "label",
                "users",
                "user_tok_s",
                "output_tok_s_per_replica",
                "accept_len",
                "verify_len_mean",
                "on_frontier",
                "rounds",
                "user_tok_s_ci_low",
                "user_tok_s_ci_high",
                "output_tok_s_ci_low",
                "output_tok_s_ci_high",
            ]
        )
        for a in arms:
            front = set(a.frontier)
            for p in sorted(a.points, key=lambda p: p.users):
                xci, yci = p.x_ci or ("", ""), p.y_ci or ("", "")
                w.writerow(
                    [a.label, p.users, p.x, p.y, p.accept_len, p.verify_len, p in front, p.rounds]
                    + [*xci, *yci]
                )


def plot_pareto(
    arms: Sequence[Arm],
    comparison: dict[str, Any] | None,
    path: Path,
    x_metric: str,
    replicas: float,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=120)
    for a in arms:
        pts = sorted(a.points, key=lambda p: p.users)
        (line,) = ax.plot([p.x for p in pts], [p.y for p in pts], "o-", label=a.label, lw=1.2)
        bars = [p for p in pts if p.x_ci and p.y_ci]
        if bars:
            ax.errorbar(
                [p.x for p in bars],
                [p.y for p in bars],
                xerr=[[p.x - p.x_ci[0] for p in bars], [p.x_ci[1] - p.x for p in bars]],
                yerr=[[p.y - p.y_ci[0] for p in bars], [p.y_ci[1] - p.y for p in bars]],
                fmt="none",
                ecolor=line.get_color(),
                elinewidth=0.8,
                capsize=2,
            )
        front = a.frontier
        ax.plot(
            [p.x for p in front],
            [p.y for p in front],
            "-",
            color=line.get_color(),
            lw=5,
            alpha=0.25,
        )
        for p in pts:
            ax.annotate(
                f"c={p.users}",
                (p.x, p.y),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=7,
                color=line.get_color(),
            )
    lines = []
    if comparison:
        tg = comparison["throughput_gain_at_matched_user_tok_s"]
        sg = comparison["user_speed_gain_at_matched_throughput"]
        name = f"{comparison['arm']} vs {comparison['baseline']}"
        if tg:
            ax.annotate(
                "",
                (tg["at"], tg["arm_value"]),
                (tg["at"], tg["baseline_value"]),
                arrowprops={"arrowstyle": "<->", "color": "black"},
            )
            ax.annotate(
                f"{tg['max_gain']:.2f}x",
                (tg["at"], (tg["arm_value"] + tg["baseline_value"]) / 2),
                textcoords="offset points",
                xytext=(5, 0),
                fontsize=9,
            )
            lines.append(
                f"throughput at matched tok/s/user: up to {tg['max_gain']:.2f}x "
                f"(at {tg['at']:.1f} tok/s/user)"
            )
        if sg:
            ax.annotate(
                "",
                (sg["arm_value"], sg["at"]),
                (sg["baseline_value"], sg["at"]),
                arrowprops={"arrowstyle": "<->", "color": "dimgray"},
            )
            ax.annotate(
                f"{sg['max_gain']:.2f}x",
                ((sg["arm_value"] + sg["baseline_value"]) / 2, sg["at"]),
                textcoords="offset points",
                xytext=(0, 5),
                fontsize=9,
                ha="center",
            )
            lines.append(
                f"tok/s/user at matched throughput: up to {sg['max_gain']:.2f}x "
                f"(at {sg['at']:.1f} tok/s)"
            )
        if not (tg or sg):
            lines.append("the frontiers do not overlap: no matched gain")
        ax.text(
            0.02,
            0.02,
            name + "\n" + "\n".join(lines),
            transform=ax.transAxes,
            fontsize=8,
            va="bottom",
            bbox={"boxstyle": "round", "fc": "white", "alpha": 0.8},
        )
    ax.set_xlabel(
        "tokens/s per user, "
        + {
            "e2e": "time to first token included",
            "mean": "after the first token (1/TPOT)",
            "p50": "after the first token, median",
        }[x_metric]
    )
    ax.set_ylabel("output tokens/s" + (f" per replica (/{replicas:g})" if replicas != 1 else ""))
    ax.set_title("Throughput vs per-user speed (thick: Pareto frontier)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def verify_series(arms: Sequence[Arm]) -> list[dict[str, Any]]:
    """Figure 8's lines: measured mean verify lengths, or an arm's fixed window."""
    out = []
    for a in arms:
        pts = sorted((p for p in a.points if p.verify_len), key=lambda p: p.users)
        if pts:
            out.append(
                {"label": a.label, "fixed": False, "points": [(p.users, p.verify_len) for p in pts]}
            )
        elif a.algorithm and a.num_draft_tokens and a.points:
            users = sorted(p.users for p in a.points)
            out.append(
                {
                    "label": f"{a.label} (fixed {a.num_draft_tokens})",
                    "fixed": True,
                    "points": [(u, float(a.num_draft_tokens)) for u in users],
                }
            )
    return out


def plot_verify(series: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for s in series:
        xs, ys = zip(*s["points"], strict=True)
        ax.plot(xs, ys, "--" if s["fixed"] else "o-", label=s["label"])
    ax.set_xscale("log", base=2)
    users = sorted({u for s in series for u, _ in s["points"]})
    ax.set_xticks(users, [str(u) for u in users])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (users)")
    ax.set_ylabel("mean verify length per request (tokens)")
    ax.set_title("Verify budget vs concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def run_pareto(
    paths: Sequence[str | Path],
    out: str | Path,
    labels: Sequence[str] = (),
    arm: str | None = None,
    baseline: str | None = None,
    replicas: float = 1.0,
    x_metric: str = "e2e",
    grid: int = 201,
    y_metric: str = "same",
) -> dict[str, Any]:
    """Read, compute, write pareto.{png,csv,json} (+ verify_budget.png); the JSON's content."""
    if grid < 2:
        raise ValueError(f"--grid must be >= 2, got {grid}")
    arms = load_arms(paths, labels, replicas, x_metric, y_metric)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pair = pick(arms, arm, baseline)
    comparison = compare(*pair, n=grid) if pair else None
    # every other speculative arm against the same baseline (reports list them beside)
    others = (
        [compare(a, pair[1], n=grid) for a in arms if a.algorithm and a not in pair] if pair else []
    )
    write_csv(arms, out / "pareto.csv")
    plot_pareto(arms, comparison, out / "pareto.png", x_metric, replicas)
    files = {"pareto_png": str(out / "pareto.png"), "pareto_csv": str(out / "pareto.csv")}
    series = verify_series(arms)
    if series:
        plot_verify(series, out / "verify_budget.png")
        files["verify_budget_png"] = str(out / "verify_budget.png")
    result = {
        "method": METHOD,
        "x_metric": X_METRICS[x_metric],
        "y_metric": f"{Y_METRICS[y_metric]} / replicas",
        "replicas": replicas,
        "arms": [
            {
                **{k: v for k, v in asdict(a).items() if k != "round_points"},
                "frontier": [asdict(p) for p in a.frontier],
            }
            for a in arms
        ],
        "comparison": comparison,
        "other_comparisons": others,
        "verify_budget": series,
        "files": files,
    }
    (out / "pareto.json").write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    files["pareto_json"] = str(out / "pareto.json")
    return result


def render_comparison(c: dict[str, Any]) -> list[str]:
    """The lines of one arm-against-baseline comparison (`compare`'s output)."""
    lines = []
    for key, text in (
        ("throughput_gain_at_matched_user_tok_s", "throughput at matched tok/s/user"),
        ("user_speed_gain_at_matched_throughput", "tok/s/user at matched throughput"),
    ):
        g = c[key]
        if g is None:
            lines.append(f"{c['arm']} vs {c['baseline']}: {text}: frontiers do not overlap")
            continue
        at_pts = ", ".join(f"c={p['users']}: {p['gain']:.2f}x" for p in g["at_baseline_points"])
        lines.append(
            f"{c['arm']} vs {c['baseline']}: {text}: max {g['max_gain']:.2f}x at "
            f"{g['at']:.2f}; at baseline points: {at_pts or '-'}"
        )
        by_round = (c.get("rounds") or {}).get(key) or {}
        for stat in ("max", "min"):
            if stat in by_round:
                e = by_round[stat]
                lines.append(
                    f"  round by round ({by_round['rounds_with_overlap']} of "
                    f"{c['rounds']['rounds']} overlap): {stat} {e['mean']:.2f}x "
                    f"[95% CI {e['ci'][0]:.2f}, {e['ci'][1]:.2f}]"
                )
    return lines


def render(result: dict[str, Any]) -> str:
    """A short text report of the arms, frontiers and gains."""
    lines = []
    for a in result["arms"]:
        front = ", ".join(f"c={p['users']} ({p['x']:.1f}, {p['y']:.1f})" for p in a["frontier"])
        lines.append(f"{a['label']}: {len(a['points'])} points; frontier (x, y): {front or '-'}")
    c = result["comparison"]
    if c is None:
        lines.append("no comparison: pass --arm and --baseline (or include a DSPARK arm)")
    else:
        lines += render_comparison(c)
    lines.append("method: " + result["method"])
    lines.append("wrote: " + ", ".join(result["files"].values()))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# command line


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="sla_summary.json files or directories holding them")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--label",
        action="append",
        default=[],
        help="arm name per summary, in order (default: each summary's label)",
    )
    p.add_argument("--arm", default=None, help="the arm to credit (default: the DSPARK arm)")
    p.add_argument(
        "--baseline",
        default=None,
        help="the arm to compare with (default: MTP / other speculative, else none)",
    )
    p.add_argument(
        "--replicas",
        type=float,
        default=1.0,
        help="divide aggregate throughput by this (per-replica numbers)",
    )
    p.add_argument(
        "--x-metric",
        choices=sorted(X_METRICS),
        default="e2e",
        help="tokens/s per user of a stage: e2e = mean of tokens / e2e (TTFT included, the SLA "
        "view); mean / p50 = mean / median of 1 / TPOT (after the first token)",
    )
    p.add_argument(
        "--y-metric",
        choices=sorted(Y_METRICS),
        default="same",
        help="aggregate tokens/s: same = from the requests x describes; window = every token "
        "generated inside the stage's window",
    )
    p.add_argument("--grid", type=int, default=201, help="grid points over each overlap")


def run(args: argparse.Namespace) -> int:
    result = run_pareto(
        args.runs,
        args.out,
        args.label,
        args.arm,
        args.baseline,
        args.replicas,
        args.x_metric,
        args.grid,
        args.y_metric,
    )
    print(render(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pareto", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"pareto: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
