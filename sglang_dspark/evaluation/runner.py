"""The evaluation run and its command line (``sglang-dspark evaluate``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sglang_dspark.drafter.config import DraftConfigError
from sglang_dspark.drafter.formats.checkpoint import (
    DraftCheckpointError,
    load_draft,
    load_mtp_draft,
)
from sglang_dspark.drafter.mtp import is_mtp_config
from sglang_dspark.drafter.training.target import TargetAdapter
from sglang_dspark.evaluation.benchmarks import (
    DEFAULT_BENCHMARKS,
    default_eval_dir,
    load_prompts,
)
from sglang_dspark.evaluation.decoding import (
    CachedTarget,
    DraftProposer,
    MtpProposer,
    Proposer,
    speculative_generate,
    target_generate,
)
from sglang_dspark.evaluation.metrics import DEFAULT_THRESHOLDS, RunRecord, build_results
from sglang_dspark.evaluation.report import write_outputs
from sglang_dspark.serving.client import chat_prompt_ids

logger = logging.getLogger(__name__)


@dataclass
class EvalConfig:
    target: str
    draft: str
    out: str
    benchmarks: list[str] = field(default_factory=lambda: list(DEFAULT_BENCHMARKS))
    eval_dir: str | None = None
    limit: int | None = 10
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    max_new_tokens: int = 128
    seed: int = 0
    thresholds: list[float] = field(default_factory=lambda: list(DEFAULT_THRESHOLDS))
    dtype: str = "float32"
    baseline: bool = False
    progress: bool = True


def prompt_seed(seed: int, benchmark: str, index: int, temperature: float) -> int:
    """A seed per (run seed, benchmark, prompt, temperature): independent of --limit/order."""
    key = f"{seed}:{benchmark}:{index}:{temperature:g}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def evaluate(
    target: CachedTarget,
    proposer: Proposer,
    prompts: dict[str, list[list[int]]],
    *,
    temperatures: Sequence[float],
    max_new_tokens: int,
    seed: int = 0,
    eos_token_ids: Iterable[int] = (),
    baseline: bool = False,
    progress: bool = True,
) -> list[RunRecord]:
    """Run every tokenized prompt of every benchmark at every temperature."""
    from tqdm.auto import tqdm

    eos = list(eos_token_ids)
    records = []
    total = len(temperatures) * sum(len(p) for p in prompts.values())
    with tqdm(total=total, desc="evaluate", unit="prompt", disable=not progress) as bar:
        for temp in temperatures:
            for name, ids_list in prompts.items():
                rec = RunRecord(name, float(temp))
                for i, ids in enumerate(ids_list):
                    s = prompt_seed(seed, name, i, temp)
                    gen = speculative_generate(
                        target,
                        proposer,
                        ids,
                        max_new_tokens=max_new_tokens,
                        temperature=temp,
                        generator=torch.Generator().manual_seed(s),
                        eos_token_ids=eos,
                    )
                    rec.add(gen)
                    if baseline:
                        ref = target_generate(
                            target,
                            ids,
                            max_new_tokens=max_new_tokens,
                            temperature=temp,
                            generator=torch.Generator().manual_seed(s),
                            eos_token_ids=eos,
                        )
                        rec.baseline_tokens += len(ref.tokens)
                        rec.baseline_s += ref.wall_s
                    tau = (len(rec.accepted) + sum(rec.accepted)) / max(len(rec.accepted), 1)
                    bar.set_postfix(T=f"{temp:g}", bench=name, tau=f"{tau:.2f}")
                    bar.update(1)
                records.append(rec)
    return records


# ---------------------------------------------------------------------------- loading
def is_mtp_draft(draft_dir: str | Path) -> bool:
    """True for an MTP-1 (EAGLE3-format NextN) draft directory."""
    path = Path(draft_dir) / "config.json"
    try:
        return is_mtp_config(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError):
        return False  # load_draft says what is wrong with the directory


def load_models(
    target_dir: str | Path, draft_dir: str | Path, *, dtype: str = "float32"
) -> tuple[CachedTarget, Proposer]:
    """Target (HF) + drafter (DSpark, or an MTP-1 draft), checked against each other (clear
    error if they do not fit)."""
    if not (Path(target_dir) / "config.json").is_file():
        raise FileNotFoundError(
            f"{target_dir} is not a Hugging Face model directory (no config.json); pass the "
            "target model directory to --target."
        )
    if is_mtp_draft(draft_dir):
        mtp = load_mtp_draft(draft_dir, target_config=target_dir)
        adapter = TargetAdapter.from_pretrained(target_dir, [0], dtype=getattr(torch, dtype))
        mtp = mtp.to(getattr(torch, dtype))
        mtp.attach_shared(adapter.embed_weight, adapter.lm_head_weight)
        return CachedTarget(adapter, features="final"), MtpProposer(mtp)
    drafter = load_draft(draft_dir, target_config=target_dir)  # validate_draft_for_target
    adapter = TargetAdapter.from_pretrained(
        target_dir, drafter.config.target_layer_ids, dtype=getattr(torch, dtype)
    )
    drafter = drafter.to(getattr(torch, dtype))
    drafter.attach_shared(adapter.embed_weight, adapter.lm_head_weight)
    return CachedTarget(adapter), DraftProposer(drafter)


def eos_ids(target_dir: str | Path, tokenizer: Any) -> list[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(str(target_dir)).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


def run_evaluation(cfg: EvalConfig) -> dict[str, Path]:
    from transformers import AutoTokenizer

    eval_dir = Path(cfg.eval_dir) if cfg.eval_dir else default_eval_dir()
    texts = {b: load_prompts(eval_dir, b, cfg.limit) for b in cfg.benchmarks}  # fail early
    target, proposer = load_models(cfg.target, cfg.draft, dtype=cfg.dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"cannot load the target tokenizer from {cfg.target} ({e}); the target directory "
            "must hold its tokenizer files (tokenizer.json / tokenizer_config.json)."
        ) from e
    prompts = {b: [chat_prompt_ids(tokenizer, t) for t in ts] for b, ts in texts.items()}
    logger.info(
        "evaluating %s on %s (gamma %d, T %s, %d new tokens)",
        cfg.draft,
        {b: len(p) for b, p in prompts.items()},
        proposer.gamma,
        cfg.temperatures,
        cfg.max_new_tokens,
    )
    records = evaluate(
        target,
        proposer,
        prompts,
        temperatures=cfg.temperatures,
        max_new_tokens=cfg.max_new_tokens,
        seed=cfg.seed,
        eos_token_ids=eos_ids(cfg.target, tokenizer),
        baseline=cfg.baseline,
        progress=cfg.progress,
    )
    config = {**asdict(cfg), "eval_dir": str(eval_dir), "torch_threads": torch.get_num_threads()}
    results = build_results(records, proposer.gamma, cfg.thresholds, config)
    paths = write_outputs(records, results, cfg.out)
    for t, r in results["results"].items():
        o = r["overall"]
        logger.info(
            "T=%s: tau %.3f, acceptance %.3f, %.1f tok/s over %d prompts",
            t,
            o["tau"] or 0.0,
            o["acceptance_rate"] or 0.0,
            o["tokens_per_s"] or 0.0,
            o["prompts"],
        )
    return paths


# ---------------------------------------------------------------------------- CLI
def _floats(text: str) -> list[float]:
    return [float(x) for x in text.replace(",", " ").split()]


def _names(text: str) -> list[str]:
    return [x for x in text.replace(",", " ").split() if x]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, help="target model directory (HF format)")
    parser.add_argument("--draft", required=True, help="DSpark draft directory (SGLang format)")
    parser.add_argument("--out", required=True, help="output directory (results.json, PNGs)")
    parser.add_argument(
        "--benchmarks",
        type=_names,
        default=list(DEFAULT_BENCHMARKS),
        help="comma-separated JSONL names in the eval dir (default gsm8k,humaneval,mt-bench)",
    )
    parser.add_argument(
        "--eval-dir",
        default=None,
        help="benchmark folder ($DSPARK_EVAL_DIR, else the packaged eval sets)",
    )
    parser.add_argument("--limit", type=int, default=10, help="prompts per benchmark (10)")
    parser.add_argument(
        "--temperatures",
        "--temperature",
        dest="temperatures",
        type=_floats,
        default=[0.0, 1.0],
        help="comma-separated sampling temperatures (default 0,1)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--thresholds",
        type=_floats,
        default=list(DEFAULT_THRESHOLDS),
        help="confidence thresholds for the static sweep",
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--baseline", action="store_true", help="also time the target alone (speedup ratio)"
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false")


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    if args.limit is not None and args.limit <= 0:
        raise ValueError(f"--limit must be positive, got {args.limit}")
    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be positive, got {args.max_new_tokens}")
    if not args.temperatures or any(t < 0 for t in args.temperatures):
        raise ValueError(f"--temperatures must be >= 0, got {args.temperatures}")
    if not args.benchmarks:
        raise ValueError("--benchmarks is empty; name at least one, e.g. gsm8k")
    return EvalConfig(
        target=args.target,
        draft=args.draft,
        out=args.out,
        benchmarks=args.benchmarks,
        eval_dir=args.eval_dir,
        limit=args.limit,
        temperatures=args.temperatures,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        thresholds=args.thresholds,
        dtype=args.dtype,
        baseline=args.baseline,
        progress=args.progress,
    )


def run(args: argparse.Namespace) -> int:
    paths = run_evaluation(config_from_args(args))
    print(paths["results"])
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Offline DSpark evaluator (see module doc).")
    add_arguments(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (DraftCheckpointError, DraftConfigError, FileNotFoundError, ValueError) as e:
        parser.exit(2, f"error: {e}\n")


if __name__ == "__main__":
    raise SystemExit(main())
