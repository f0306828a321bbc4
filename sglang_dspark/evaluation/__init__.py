"""Offline evaluator: reference speculative decoding with the target and the DSpark drafter.

    sglang-dspark evaluate --target DIR --draft DIR --out DIR \\
        [--benchmarks gsm8k,humaneval,mt-bench] [--limit N] [--temperatures 0,1] \\
        [--max-new-tokens N]
    python -m sglang_dspark.evaluation ...            (the same, without the umbrella CLI)

One prompt at a time, chain drafting, no scheduler, in plain PyTorch. Modules:
``decoding`` (the speculative loop: KV-cached target, drafter proposals, verification),
``metrics`` (tau, acceptance rate, position-wise acceptance P(accept k | 1..k-1 accepted),
static confidence-threshold sweep), ``benchmarks`` (JSONL prompts, chat template),
``compare`` (paired comparison of drafters, ``sglang-dspark compare``), ``report`` (results.json, calibration.npz for the STS fitter, PNG plots), ``runner``
(the run and its command line: ``add_arguments`` / ``run``).
"""

from sglang_dspark.evaluation.benchmarks import (
    DEFAULT_BENCHMARKS,
    DOMAINS,
    default_eval_dir,
    load_prompts,
)
from sglang_dspark.evaluation.decoding import (
    CachedTarget,
    DraftProposer,
    Generation,
    MtpProposer,
    Proposal,
    Proposer,
    Round,
    sample,
    speculative_generate,
    target_generate,
    verify_block,
)
from sglang_dspark.evaluation.metrics import (
    DEFAULT_THRESHOLDS,
    RunRecord,
    acceptance_metrics,
    build_results,
    summarize,
    threshold_sweep,
    verified_lengths,
)
from sglang_dspark.evaluation.report import write_calibration, write_outputs, write_plots
from sglang_dspark.evaluation.runner import (
    EvalConfig,
    add_arguments,
    evaluate,
    load_models,
    main,
    run,
    run_evaluation,
)

__all__ = [
    "DEFAULT_BENCHMARKS",
    "DEFAULT_THRESHOLDS",
    "DOMAINS",
    "CachedTarget",
    "DraftProposer",
    "EvalConfig",
    "Generation",
    "MtpProposer",
    "Proposal",
    "Proposer",
    "Round",
    "RunRecord",
    "acceptance_metrics",
    "add_arguments",
    "build_results",
    "default_eval_dir",
    "evaluate",
    "load_models",
    "load_prompts",
    "main",
    "run",
    "run_evaluation",
    "sample",
    "speculative_generate",
    "summarize",
    "target_generate",
    "threshold_sweep",
    "verified_lengths",
    "verify_block",
    "write_calibration",
    "write_outputs",
    "write_plots",
]
