"""`dspark_verify_trace`: what each DSPARK step really verified, one JSON line per step.

`SGLANG_DSPARK_VERIFY_TRACE=stem` makes every scheduler process append to
`stem.rank<R>.jsonl`, per verify step: the confidences the scheduler read (calibrated, the
tensor `schedule_layout` was given), the verify lengths of the layout the target really ran
(anchor included; `null` when the step ran SGLang's static layout: every draft), the drafts
accepted, the budget, the graph tier, and the wall-clock time the step ended. It is the ground truth behind two things:

- the verify-length equality test (`tests/test_scheduling_serving.py`): the server's lengths
  against `sglang_dspark.scheduling.scheduler.schedule_sync` on the same confidences and SPS table;
- the verify window per request against concurrency (the paper's Figure 8,
  `benchmarks/serving.py`'s `verify_budget.png`).

Lines are written and flushed per step (a trace is a debugging tool; it costs a host copy of
the confidences). Unset, the hook does nothing.
"""

from __future__ import annotations

import json
import os
import time

from sglang_dspark.plugin.registry import register_after

TRACE_ENV = "SGLANG_DSPARK_VERIFY_TRACE"

_files: dict[str, object] = {}


def trace_path(stem: str, rank: int) -> str:
    return f"{stem}.rank{rank}.jsonl"


def _cpu_list(t, bs: int):
    import torch

    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach()[:bs].to("cpu").tolist()


def step_record(
    *, forward_ct, bs, layout, confidence, correct_len, verify_token_budget, verify_tier_num_tokens
) -> dict:
    import torch

    lens = getattr(layout, "verify_lens", None) if layout is not None else None
    conf = None
    if confidence is not None:  # exact: float64 holds every float32, JSON round-trips it
        conf = confidence.detach()[:bs].to("cpu", torch.float64).tolist()
    return {
        "time": time.time(),  # wall clock at the end of the step (durations between steps)
        "step": int(forward_ct),
        "bs": int(bs),
        "confidence": conf,
        "verify_lens": _cpu_list(lens, bs),
        "accepted": _cpu_list(correct_len, bs),
        "budget": None if verify_token_budget is None else int(verify_token_budget),
        "tier_tokens": None if verify_tier_num_tokens is None else int(verify_tier_num_tokens),
    }


def _trace(result, observers, *args, **kw):
    stem = os.environ.get(TRACE_ENV, "")
    if not stem:
        return result
    from sglang_dspark.plugin.parallel import global_rank

    path = trace_path(stem, global_rank())
    f = _files.get(path)
    if f is None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        f = _files[path] = open(path, "a", buffering=1)  # noqa: SIM115 - kept for the process
    record = step_record(
        forward_ct=kw.get("forward_ct", 0),
        bs=int(kw.get("bs", 0)),
        layout=kw.get("layout"),
        confidence=kw.get("confidence"),
        correct_len=kw.get("correct_len"),
        verify_token_budget=kw.get("verify_token_budget"),
        verify_tier_num_tokens=kw.get("verify_tier_num_tokens"),
    )
    f.write(json.dumps(record) + "\n")
    return result


def read_trace(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def install() -> None:
    register_after(
        "sglang.srt.speculative.dspark_components.dspark_observability.DsparkStepObservers"
        ".observe_verify_step",
        _trace,
    )


HOOKS = {"dspark_verify_trace": install}
