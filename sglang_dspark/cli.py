"""`sglang-dspark`: the project's command line."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys


def _cmd_patches(args: argparse.Namespace) -> int:
    from sglang_dspark.serving import patching

    patching.check_sglang_version()
    if args.action == "apply":
        result = patching.apply()
    elif args.action == "revert":
        result = patching.revert()
    else:
        result = patching.status()
    root = patching.sglang_root()
    for s in result:
        print(f"{s.name}: {s.state.value}")
    print(f"(sglang at {root})")
    bad = [s for s in result if s.state is not patching.PatchState.APPLIED]
    if args.action == "check" and bad:
        return 1
    return 0


def _cmd_setup_smollm2(args: argparse.Namespace) -> int:
    from sglang_dspark.serving.smollm2 import ensure_smollm2

    print(ensure_smollm2(args.out, dtype=args.dtype))
    return 0


def _cmd_setup_tiny_v4(args: argparse.Namespace) -> int:
    from sglang_dspark.v4.tiny import build_tiny_v4

    print(build_tiny_v4(args.out, seed=args.seed, with_draft=not args.no_draft, force=args.force))
    return 0


def _cmd_embedded(args: argparse.Namespace) -> int:
    from sglang_dspark.serving import embedded

    paths = embedded.ensure(dtype=args.dtype)
    if args.print_command:
        cmd = embedded.launch_command(paths, port=args.port, dtype=args.dtype, arm=args.arm)
        print(shlex.join(cmd))  # no environment needed: the plugin sets up the CPU engine
    else:
        print(f"target: {paths.target}\ndraft:  {paths.draft}\nmtp1:   {paths.mtp1_draft}")
    return 0


def _lazy(module: str, add: str, run: str):
    """Subcommands from modules that import torch: load them only when used."""
    import importlib

    mod = importlib.import_module(module)
    return getattr(mod, add), getattr(mod, run)


def _chosen_command(argv: list[str] | None) -> str | None:
    """The subcommand named on the command line (first word that is not an option)."""
    words = sys.argv[1:] if argv is None else argv
    return next((w for w in words if not w.startswith("-")), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Only the chosen subcommand's module is imported: the others' (torch, SGLang) are not
    needed to run it, so `train` or `data` work where SGLang is not installed."""
    chosen = _chosen_command(argv)
    parser = argparse.ArgumentParser(prog="sglang-dspark", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("patches", help="check or apply our patches to the installed sglang")
    p.add_argument("action", choices=["check", "apply", "revert"])
    p.set_defaults(func=_cmd_patches)

    p = sub.add_parser("setup-smollm2", help="convert the embedded SmolLM2 target once")
    p.add_argument("--out", default=None, help="output dir (default: the cache)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.set_defaults(func=_cmd_setup_smollm2)

    p = sub.add_parser(
        "setup-tiny-v4",
        help="build a tiny DeepSeek-V4 checkpoint with a bundled DSpark draft (random weights)",
    )
    p.add_argument("--out", default=None, help="output dir (default: the cache)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--no-draft", action="store_true", help="leave out the DSpark draft")
    p.add_argument(
        "--force", action="store_true", help="rebuild a build made for another seed or draft"
    )
    p.set_defaults(func=_cmd_setup_tiny_v4)

    p = sub.add_parser("embedded", help="set up the embedded default (SmolLM2 + its drafter)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--print-command", action="store_true", help="print the launch command")
    p.add_argument(
        "--arm", default="dspark", choices=["dspark", "mtp1", "plain"],
        help="what --print-command starts: DSPARK (default), the MTP-1 baseline (EAGLE3 worker, "
        "one draft token per round) or no speculation",
    )  # fmt: skip
    p.set_defaults(func=_cmd_embedded)

    for name, module, add, run, text in [
        (
            "demo",
            "sglang_dspark.serving.demo",
            "add_arguments",
            "run",
            "start the embedded DSPARK server, send one request, stop it",
        ),
        (
            "make-draft",
            "sglang_dspark.drafter.formats.checkpoint",
            "add_make_draft_arguments",
            "run_make_draft",
            "write a randomly initialised SGLang DSpark draft for a target",
        ),
        (
            "export",
            "sglang_dspark.drafter.formats.checkpoint",
            "add_export_arguments",
            "run_export",
            "export a trained / DeepSpec drafter as an SGLang checkpoint",
        ),
        (
            "train",
            "sglang_dspark.drafter.training.cli",
            "add_arguments",
            "run",
            "train a DSpark drafter against a frozen target",
        ),
        (
            "draft-vocab",
            "sglang_dspark.drafter.formats.draft_vocab",
            "add_arguments",
            "run",
            "a reduced draft vocabulary: the N most frequent response tokens of the training data",
        ),
        (
            "bundle-v4-draft",
            "sglang_dspark.drafter.formats.checkpoint_v4",
            "add_bundle_arguments",
            "run_bundle",
            "bundle a trained DeepSeek-V4 DSpark draft into a copy of its target",
        ),
        (
            "evaluate",
            "sglang_dspark.evaluation",
            "add_arguments",
            "run",
            "offline evaluator: tau, position-wise acceptance, threshold sweep",
        ),
        (
            "compare",
            "sglang_dspark.evaluation.compare",
            "add_arguments",
            "run",
            "paired comparison of drafters on the same prompts and seeds: tau table, CIs",
        ),
        (
            "curves",
            "sglang_dspark.evaluation.curves",
            "add_arguments",
            "run",
            "held-out learning curves of training runs (their eval.jsonl): plot and table",
        ),
        (
            "audit",
            "sglang_dspark.verification.audit",
            "add_arguments",
            "run",
            "check that a running DSPARK server is lossless (exit code 0 / 1)",
        ),
        (
            "calibrate",
            "sglang_dspark.calibration.cli",
            "add_arguments",
            "run",
            "fit STS temperatures (SGLang DSparkStsCalibration JSON)",
        ),
        (
            "data",
            "sglang_dspark.data.cli",
            "add_arguments",
            "run",
            "build training prompts and target-regenerated responses",
        ),
        (
            "sps",
            "sglang_dspark.scheduling.sps",
            "add_arguments",
            "run",
            "SPS(B) cost table: profile on the embedded server, plot",
        ),
        (
            "pareto",
            "sglang_dspark.measurement.pareto",
            "add_arguments",
            "run",
            "Pareto curves (Figures 7, 8) from loadtest/sla.py summaries",
        ),
    ]:
        p = sub.add_parser(name, help=text)
        if name != chosen:
            continue
        add_fn, run_fn = _lazy(module, add, run)
        add_fn(p)
        p.set_defaults(func=run_fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"sglang-dspark: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
