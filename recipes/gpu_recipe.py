#!/usr/bin/env python3
"""Train the embedded SmolLM2 drafters on one GPU machine that reaches no network.

    python recipes/gpu_recipe.py pack --out .gpu-bundle [--init dspark=DIR ...]   # here
    python recipes/gpu_recipe.py run --bundle BUNDLE --out OUT             # there, on the GPU
    python recipes/gpu_recipe.py unpack --parts DIR --out RUNS             # here, afterwards

Such a machine (our device tool's H200; an air-gapped training box) has torch, transformers,
safetensors and tqdm, but no SGLang, no `gguf` and no network. The training data travel in
the repository tree (recipes/data: the 2.2 M-token T=0.7 responses and the held-out T=1 set),
so `pack` only bundles what the tree lacks: the target as the wheel's Q4_1 GGUF, the `gguf`
wheel, the drafters to start from when they are not the shipped ones (`--init ARM=DIR`, e.g.
the drafters a previous run brought back), and with `--regenerate` the prompts to answer
anew. The bundle is one tar cut into parts, one part per device call (the device tool carries
at most 64 MiB a call: tree + part); `manifest.json` (with the last part) lists the calls.

`run` then, in one command: joins and checks the bundle, installs the carried wheels,
converts the target, and trains each arm (default: `dspark` = configs/smollm2-dspark.json,
`mtp1` = the MTP-1 baseline, `dflash` = DSpark without its Markov bias) on the same data,
steps, batch and seed, each from its starting drafter (the shipped one unless `--init` carried
another, or `--from-scratch`; the optimizer restarts warm-up: a warm restart), with held-out
curves (`--eval-data`: per-position acceptance on T=1 samples, every `--eval-every` steps).
Features stay on the GPU (`--feature-cache-gb`). The step count is sized from a short probe
so that every arm fits `--budget-s`; each arm also has a time box. After each arm it rewrites
OUT/results.tar.part-N (at most 7 parts of 15 MiB: the device tool brings back 8 files of
16 MiB) and OUT/recipe.json (what ran, times, steps, held-out accept lengths, sha256s), so a
command killed at its limit still returns the arms that finished. `unpack` joins, checks and
extracts them; `pack --init arm=RUNS/arm/draft` carries them into the next run.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
CARRY_LIMIT_MIB = 64  # the device tool's working tree + carried paths, per call
RESULT_PART_MIB = 15  # under the device tool's 16 MiB per returned file
MAX_RESULT_PARTS = 7  # + recipe.json = the tool's 8 returned files
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Arms: (training config, extra trainer flags, shipped drafter it starts from). All share
# data, steps, batch and seed.
ARMS: dict[str, tuple[str, list[str], str]] = {
    "dspark": ("configs/smollm2-dspark.json", [], "sglang_dspark/assets/smollm2-dspark"),
    "mtp1": ("configs/smollm2-mtp1.json", [], "sglang_dspark/assets/smollm2-mtp1"),
    "dflash": ("configs/smollm2-dspark.json", ["--dflash"], "sglang_dspark/assets/smollm2-dspark"),
}
DATA = "recipes/data/smollm2-regen-t07"
HELDOUT = "recipes/data/smollm2-heldout-t1"


class RecipeError(RuntimeError):
    """What went wrong and what to do (exit 2)."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            h.update(chunk)
    return h.hexdigest()


def _sh(cmd: list[str], env: dict | None = None, log: Path | None = None) -> None:
    print("+", shlex.join(cmd), flush=True)
    out = log.open("a") if log else None
    try:
        proc = subprocess.run(
            cmd, check=False, env=env, stdout=out, stderr=subprocess.STDOUT if out else None
        )
    finally:
        if out:
            out.close()
    if proc.returncode:
        tail = log.read_text()[-3000:] if log and log.is_file() else ""
        raise RecipeError(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n{tail}")


# ---------------------------------------------------------------------------- pack (here)
def tree_mib(repo: Path = REPO) -> float:
    """What the device tool sends every call: tracked + untracked-not-ignored files."""
    names = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True,
    ).stdout.split(b"\0")  # fmt: skip
    paths = [repo / n.decode() for n in names if n]
    return sum(p.stat().st_size for p in paths if p.is_file()) / MIB


def plan_calls(total_bytes: int, room_mib: float) -> list[list[int]]:
    """Cut ``total_bytes`` into [start, end) ranges of at most ``room_mib`` MiB: one per call."""
    room = int(room_mib * MIB)
    if room <= 0:
        raise RecipeError(
            f"no room to carry anything: the repository tree leaves {room_mib:.1f} MiB of the "
            f"{CARRY_LIMIT_MIB} MiB per call; ignore or remove large untracked files"
        )
    return [[a, min(a + room, total_bytes)] for a in range(0, total_bytes, room)]


def parse_init(items: list[str] | None) -> dict[str, Path]:
    """``ARM=DIR`` pairs: the drafters to start from instead of the shipped ones."""
    out = {}
    for item in items or []:
        arm, sep, path = item.partition("=")
        if not sep or arm not in ARMS:
            raise RecipeError(f"--init {item!r}: give ARM=DIR with ARM one of {', '.join(ARMS)}")
        if not (Path(path) / "config.json").is_file():
            raise RecipeError(f"--init {item!r}: {path} is not a drafter directory (no "
                              "config.json); pass the `draft` folder `unpack` wrote")  # fmt: skip
        out[arm] = Path(path)
    return out


def cmd_pack(args: argparse.Namespace) -> int:
    from sglang_dspark.serving.smollm2 import ensure_smollm2, gguf_path

    init = parse_init(args.init)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    staging = out / "staging"
    staging.mkdir()
    py = [sys.executable]
    domains = "code,chat,math,writing"
    if args.regenerate:
        _sh([*py, "-m", "sglang_dspark.cli", "data", "prompts", "--out",
             str(staging / "prompts.jsonl"), "--per-domain", str(args.per_domain), "--seed",
             str(args.seed), "--domains", domains])  # fmt: skip
        _sh([*py, str(REPO / "recipes" / "prompt_sequences.py"), "--target",
             str(ensure_smollm2()), "--out", str(staging / "prompt-seqs.jsonl"), "--per-domain",
             str(args.prompt_seqs_per_domain), "--seed", "1"])  # fmt: skip
    wheels = staging / "wheels"
    wheels.mkdir()
    for w in args.wheel or []:
        shutil.copy2(w, wheels)
    if args.download_wheels:
        from importlib.metadata import version

        _sh([*py, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", args.python_version, "-d", str(wheels),
             f"gguf=={version('gguf')}"])  # fmt: skip
    for arm, src in init.items():
        shutil.copytree(src, staging / "init" / arm)
    src = gguf_path()
    shutil.copy2(src, staging / GGUF)
    tar_path = out / "bundle.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(staging, arcname=".")
    shutil.rmtree(staging)
    room = CARRY_LIMIT_MIB - tree_mib() - args.margin_mib
    if args.part_mib:
        room = min(room, args.part_mib)
    ranges = plan_calls(tar_path.stat().st_size, room)
    calls = []
    with tar_path.open("rb") as f:
        for i, (a, b) in enumerate(ranges):
            d = out / f"call-{i + 1}"
            d.mkdir()
            f.seek(a)
            (d / f"bundle.part-{i:02d}").write_bytes(f.read(b - a))
            calls.append(str(d.relative_to(REPO) if d.is_relative_to(REPO) else d))
    manifest = {
        "bundle": {"bytes": tar_path.stat().st_size, "sha256": sha256(tar_path),
                   "parts": [f"bundle.part-{i:02d}" for i in range(len(ranges))]},
        "gguf": {"name": GGUF, "bytes": src.stat().st_size, "sha256": sha256(src)},
        "init": {arm: str(path) for arm, path in init.items()},
        "regenerate": bool(args.regenerate),
        "prompts": {"per_domain": args.per_domain, "seed": args.seed, "domains": domains},
        "prompt_seqs_per_domain": args.prompt_seqs_per_domain,
        "calls": calls,
        "room_mib_per_call": round(room, 2),
    }  # fmt: skip
    tar_path.unlink()
    (out / f"call-{len(ranges)}" / "manifest.json").write_text(json.dumps(manifest, indent=2))
    print(f"bundle: {out} ({len(calls)} device calls, {room:.1f} MiB room per call)")
    gather = "mkdir -p /tmp/gpu-bundle && cp -r {d}/. /tmp/gpu-bundle/"
    for i, c in enumerate(calls):
        cmd = gather.format(d=c)
        if i == len(calls) - 1:
            cmd += (" && PYTHONUNBUFFERED=1 python3 recipes/gpu_recipe.py run --bundle "
                    "/tmp/gpu-bundle --out $OUT --budget-s 500")  # fmt: skip
        print(f"device call {i + 1}: carry={json.dumps([c])} command={cmd!r}")
    return 0


# ---------------------------------------------------------------------------- run (there)
class Results:
    """OUT/results.tar.part-N and OUT/recipe.json, rewritten after each phase."""

    def __init__(self, out: Path, work: Path) -> None:
        self.out, self.work = out, work
        self.record: dict = {"phases": {}, "arms": {}, "started": time.time()}
        out.mkdir(parents=True, exist_ok=True)

    def phase(self, name: str, seconds: float, **info) -> None:
        self.record["phases"][name] = {"seconds": round(seconds, 1), **info}
        self.flush()

    def flush(self) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for arm in self.record["arms"]:
                run = self.work / "runs" / arm
                for rel in ("draft", "metrics.jsonl", "eval.jsonl"):
                    if (run / rel).exists():
                        tar.add(run / rel, arcname=f"{arm}/{rel}")
            summary = self.work / "data" / "regen" / "summary.json"
            if summary.is_file():
                tar.add(summary, arcname="data-summary.json")
        data = buf.getvalue()
        for old in self.out.glob("results.tar.part-*"):
            old.unlink()
        size = RESULT_PART_MIB * MIB
        parts = [data[i : i + size] for i in range(0, len(data), size)]
        if len(parts) > MAX_RESULT_PARTS:
            self.record["error"] = (f"results are {len(data) / MIB:.0f} MiB, more than "
                                    f"{MAX_RESULT_PARTS} parts of {RESULT_PART_MIB} MiB; "
                                    "run fewer arms per command")  # fmt: skip
            parts = []
        for i, part in enumerate(parts):
            (self.out / f"results.tar.part-{i}").write_bytes(part)
        self.record["results"] = {"sha256": hashlib.sha256(data).hexdigest(), "parts": len(parts)}
        self.record["elapsed_s"] = round(time.time() - self.record["started"], 1)
        tmp = self.out / "recipe.json.tmp"
        tmp.write_text(json.dumps(self.record, indent=2))
        os.replace(tmp, self.out / "recipe.json")


def join_bundle(bundle: Path, work: Path) -> tuple[dict, Path]:
    """The bundle's parts joined, checked and extracted into work/bundle; (manifest, dir)."""
    manifest_path = bundle / "manifest.json"
    if not manifest_path.is_file():
        raise RecipeError(f"{manifest_path} is missing: carry the last call's folder of the "
                          "bundle (it holds the manifest) before `run`")  # fmt: skip
    manifest = json.loads(manifest_path.read_text())
    m = manifest["bundle"]
    missing = [p for p in m["parts"] if not (bundle / p).is_file()]
    if missing:
        raise RecipeError(f"bundle parts missing from {bundle}: {missing}; carry every call's "
                          "folder (see `pack`'s output) on the same warm machine first")  # fmt: skip
    h, buf = hashlib.sha256(), io.BytesIO()
    for p in m["parts"]:
        data = (bundle / p).read_bytes()
        h.update(data)
        buf.write(data)
    if h.hexdigest() != m["sha256"]:
        raise RecipeError(f"the joined bundle has sha256 {h.hexdigest()[:16]}..., the "
                          f"manifest's is {m['sha256'][:16]}...: a part is corrupt or from "
                          "another pack; pack again and carry every part")  # fmt: skip
    out = work / "bundle"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    buf.seek(0)
    with tarfile.open(fileobj=buf) as tar:
        tar.extractall(out, filter="data")
    return manifest, out


def _probe_seconds_per_step(metrics: Path) -> float:
    rows = [json.loads(line) for line in metrics.open() if line.strip()]
    if len(rows) < 2:
        raise RecipeError(f"the probe logged {len(rows)} steps; raise --probe-steps")
    skip = min(2, len(rows) - 2)  # the first steps carry warm-up (allocator, kernels)
    return (rows[-1]["elapsed_s"] - rows[skip]["elapsed_s"]) / (len(rows) - 1 - skip)


def cmd_run(args: argparse.Namespace) -> int:
    t_start = time.time()
    deadline = t_start + args.budget_s
    out, work = Path(args.out), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    results = Results(out, work)
    log = out / "recipe.log"
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise RecipeError(f"unknown arms {unknown}; choose from {', '.join(ARMS)}")
    results.record.update(arms_planned=arms, argv=sys.argv[1:])

    t = time.time()
    manifest, bundle = join_bundle(Path(args.bundle), work)
    gguf = bundle / manifest["gguf"]["name"]
    if sha256(gguf) != manifest["gguf"]["sha256"]:
        raise RecipeError(f"{gguf} does not match the manifest's sha256; pack again")
    env = dict(os.environ)
    wheels = sorted((bundle / "wheels").glob("*.whl")) if (bundle / "wheels").is_dir() else []
    if wheels:
        site = work / "site"
        _sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--upgrade", "--target", str(site), *map(str, wheels)], log=log)  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
        sys.path.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    sys.path.insert(0, str(REPO))
    from sglang_dspark.serving.smollm2 import ensure_smollm2

    target = ensure_smollm2(work / "SmolLM2-135M-Instruct-bfloat16", gguf=gguf)
    results.phase("target", time.time() - t, gguf_sha256=manifest["gguf"]["sha256"])

    t = time.time()
    cli = [sys.executable, "-m", "sglang_dspark.cli"]
    if args.regenerate:
        if not (bundle / "prompts.jsonl").is_file():
            raise RecipeError("--regenerate needs the prompts: pack with --regenerate")
        _sh([*cli, "data", "build", "--out", str(work / "data" / "regen"), "--target",
             str(target), "--backend", "hf", "--device", args.device, "--dtype", "bfloat16",
             "--prompts", str(bundle / "prompts.jsonl"), "--batch-size",
             str(args.gen_batch_size), "--max-new-tokens", str(args.max_new_tokens),
             "--temperature", str(args.temperature), "--seed", str(args.seed),
             "--no-progress"], env=env, log=log)  # fmt: skip
        train_dir = work / "data" / "train"
        train_dir.mkdir(parents=True, exist_ok=True)
        for f in (work / "data" / "regen").glob("*.jsonl"):
            shutil.copy2(f, train_dir / f"regen-{f.name}")
        shutil.copy2(bundle / "prompt-seqs.jsonl", train_dir / "prompt-seqs.jsonl")
    else:
        train_dir = Path(args.data)
    from sglang_dspark.drafter.training.data import load_sequences

    n_seq = len(load_sequences(train_dir, max_length=10**9))
    results.phase("data", time.time() - t, sequences=n_seq, data=str(train_dir),
                  regenerated=bool(args.regenerate))  # fmt: skip

    common = ["--target", str(target), "--data", str(train_dir), "--seed", str(args.seed),
              "--device", args.device, "--feature-cache-gb", str(args.feature_cache_gb),
              "--global-batch-size", str(args.global_batch_size),
              "--micro-batch-size", str(args.micro_batch_size), "--no-progress",
              "--checkpoint-every", str(args.checkpoint_every)]  # fmt: skip
    if args.feature_store:
        common += ["--feature-store", str(work / "features")]
    common += shlex.split(args.train_args)
    curves = ["--eval-data", str(args.eval_data), "--eval-every", str(args.eval_every)]

    def start(arm: str) -> str | None:
        if args.from_scratch:
            return None
        carried = bundle / "init" / arm
        return str(carried if carried.is_dir() else REPO / ARMS[arm][2])

    def train_cmd(arm: str, out_dir: Path, *extra: str, held_out: bool = True) -> list[str]:
        config, flags, _ = ARMS[arm]
        shape = shlex.split(args.dspark_args) if arm != "mtp1" else []
        init = ["--init-draft", start(arm)] if start(arm) else []
        held = curves if held_out and args.eval_data else []
        return [*cli, "train", "--config", str(REPO / config), "--out-dir", str(out_dir),
                *common, *held, *init, *flags, *shape, *extra]  # fmt: skip

    steps = args.steps
    if args.probe_steps:
        t = time.time()
        probe = work / "probe"
        shutil.rmtree(probe, ignore_errors=True)
        _sh(train_cmd(arms[0], probe, "--steps", str(args.steps), "--stop-after",
                      str(args.probe_steps), held_out=False), env=env, log=log)  # fmt: skip
        per_step = _probe_seconds_per_step(probe / "metrics.jsonl")
        left = deadline - time.time() - args.reserve_s
        fit = int(left / (per_step * len(arms) * 1.15))  # 15% for loads, features, export
        steps = max(1, min(args.steps, fit))
        results.phase("probe", time.time() - t, seconds_per_step=round(per_step, 4),
                      steps=steps, steps_asked=args.steps)  # fmt: skip
    for i, arm in enumerate(arms):
        t = time.time()
        left = deadline - t - args.reserve_s
        box = max(30.0, left / (len(arms) - i))
        run_dir = work / "runs" / arm
        _sh(train_cmd(arm, run_dir, "--steps", str(steps), "--time-limit-s", f"{box:.0f}"),
            env=env, log=log)  # fmt: skip
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if line.strip()]
        last = rows[-20:]
        evals = []
        if (run_dir / "eval.jsonl").is_file():
            evals = [json.loads(x) for x in (run_dir / "eval.jsonl").open() if x.strip()]
        results.record["arms"][arm] = {
            "seconds": round(time.time() - t, 1),
            "steps": rows[-1]["step"],
            "steps_planned": steps,
            "time_boxed": rows[-1]["step"] < steps,
            "init": start(arm) or "scratch",
            "sequences_seen": rows[-1]["step"] * args.global_batch_size,
            "lm_head_positions": sum(r["lm_head_positions"] for r in rows),
            "accept_proxy_last20": round(sum(r["accept"] for r in last) / len(last), 4),
            "loss_last20": round(sum(r["loss"] for r in last) / len(last), 4),
            "heldout_tau": {str(e["step"]): e["tau_estimate"] for e in evals},
            "command": shlex.join(train_cmd(arm, Path(f"RUNS/{arm}"), "--steps", str(steps))),
        }
        results.flush()
    print(json.dumps(results.record, indent=2))
    return 0


# ---------------------------------------------------------------------------- unpack (here)
def cmd_unpack(args: argparse.Namespace) -> int:
    src, out = Path(args.parts), Path(args.out)
    recipe = json.loads((src / "recipe.json").read_text())
    parts = sorted(src.glob("results.tar.part-*"), key=lambda p: int(p.name.rsplit("-", 1)[1]))
    if len(parts) != recipe["results"]["parts"]:
        raise RecipeError(f"{src} holds {len(parts)} result parts, recipe.json names "
                          f"{recipe['results']['parts']}")  # fmt: skip
    data = b"".join(p.read_bytes() for p in parts)
    if hashlib.sha256(data).hexdigest() != recipe["results"]["sha256"]:
        raise RecipeError("the joined results do not match recipe.json's sha256: a part is "
                          "missing or cut; fetch the files again")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(out, filter="data")
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2))
    for arm, info in recipe["arms"].items():
        boxed = " (time-boxed)" if info["time_boxed"] else ""
        tau = info.get("heldout_tau") or {}
        held = f", held-out accept length {' -> '.join(map(str, tau.values()))}" if tau else ""
        print(
            f"{arm}: {out / arm / 'draft'}  {info['steps']} steps{boxed}, "
            f"accept proxy {info['accept_proxy_last20']}{held}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="here: the bundle to carry (GGUF, wheels, init drafters)")
    p.add_argument("--out", default=str(REPO / ".gpu-bundle"))
    p.add_argument(
        "--init",
        action="append",
        metavar="ARM=DIR",
        help="start ARM from this drafter instead of the shipped one (repeatable)",
    )
    p.add_argument(
        "--regenerate",
        action="store_true",
        help="carry prompts so that `run --regenerate` answers them anew",
    )
    p.add_argument("--per-domain", type=int, default=500, help="training prompts per domain")
    p.add_argument("--prompt-seqs-per-domain", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wheel", action="append", help="a wheel file to carry (repeatable)")
    p.add_argument(
        "--download-wheels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="download the gguf wheel for the GPU machine's Python (PyPI)",
    )
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    p.add_argument("--margin-mib", type=float, default=1.0)
    p.add_argument("--part-mib", type=float, default=None, help="cap a call's part size")
    p = sub.add_parser("run", help="there: join, convert, generate, train, write OUT")
    p.add_argument("--bundle", required=True)
    p.add_argument("--out", required=True, help="where results go ($OUT on the device)")
    p.add_argument("--work", default="/tmp/gpu-recipe")
    p.add_argument("--arms", default="dspark,mtp1,dflash")
    p.add_argument("--data", default=str(REPO / DATA), help="training data (default: in the tree)")
    p.add_argument(
        "--regenerate",
        action="store_true",
        help="train on responses generated here from the bundle's prompts instead",
    )
    p.add_argument(
        "--eval-data",
        default=str(REPO / HELDOUT),
        help="held-out T=1 samples for the curves ('' for none)",
    )
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--from-scratch", action="store_true", help="new drafters, not the shipped ones")
    p.add_argument("--train-args", default="", help="extra trainer flags for every arm")
    p.add_argument(
        "--feature-cache-gb",
        type=float,
        default=48.0,
        help="target features kept on the device (the whole data set: about 15)",
    )
    p.add_argument(
        "--feature-store",
        action="store_true",
        help="also share features between arms through the disk",
    )
    p.add_argument("--dspark-args", default="", help="extra trainer flags for dspark and dflash")
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, default=20000, help="upper bound; the probe sizes it")
    p.add_argument("--probe-steps", type=int, default=12, help="0: train --steps as given")
    p.add_argument("--budget-s", type=float, default=500.0, help="the whole command's time")
    p.add_argument("--reserve-s", type=float, default=20.0, help="kept for writing results")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=32)
    p.add_argument("--checkpoint-every", type=int, default=250)
    p.add_argument("--gen-batch-size", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument(
        "--temperature",
        type=float,
        default=0.7,
        help="sampling temperature of the regenerated responses (0 = greedy)",
    )
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("unpack", help="here: join and extract the returned results")
    p.add_argument("--parts", required=True, help="the folder the device's files landed in")
    p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        return {"pack": cmd_pack, "run": cmd_run, "unpack": cmd_unpack}[args.command](args)
    except RecipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
