"""Confidence-scheduled verification in SGLang's DSPARK worker: scheduler modes, SPS at start-up.

`SGLANG_DSPARK_SCHEDULER` picks how many drafts each request verifies per step:

- `static`: every draft (upstream `SGLANG_RAGGED_VERIFY_MODE=static`).
- `async`:  upstream's asynchronous planner (`compact` verify; capacity K from the
  confidences of two steps earlier, top-K of the current survivals).
- `sync`:   Algorithm 1 with its early stop on the CURRENT step's confidences
  (`sglang_dspark.scheduling.scheduler.schedule_sync`). SGLang is handed its per-request lengths
  themselves, not a budget for its own top-K kernel to re-derive lengths from (that kernel
  works in float32 with its own `survival_eps` and tie order). The overlap scheduler is
  turned off, so the confidences read are this step's.

Unset, a DSPARK launch gets its device's default (`DEFAULT_MODES`, `default_mode`), unless
`SGLANG_RAGGED_VERIFY_MODE` is set: then SGLang behaves as upstream in that mode.

- CPU: `sync`. Algorithm 1 on the current step's confidences, overlap scheduling off; on the
  embedded CPU default it was the fastest mode measured (docs/results.md), and a CPU
  server gains nothing from overlap (the host does the GPU's work too).
- CUDA (and any other accelerator): `async`, upstream's planner, which keeps SGLang's overlap
  scheduler on, as the chart's GPU profiles have it. `sync` only when asked.

Hooks:

- `dspark_scheduler_mode`: maps the mode to `SGLANG_RAGGED_VERIFY_MODE`, refuses a conflicting
  explicit value, and turns off the overlap scheduler for `sync`. The default is set while the
  launcher resolves a DSPARK launch's arguments (only DSPARK reads it), so every process that
  SGLang starts afterwards inherits it.
- `dspark_sync_scheduler`: `sync`'s lengths. `HostConfidenceBudgetPlanner.compute_budget`
  runs Algorithm 1 and puts its lengths, with the budget it returns, on the step's confidence
  tensor (attribute `dspark_sync`): the tensor SGLang hands from that step's budget to that
  step's layout, so the lengths travel with the step, never through shared state. On a GPU
  the planner reads a CPU copy of the confidences; `DSparkVerifyPlanner.compute_budget_sync`
  (hooked too) moves the lengths onto the step's own tensor. The planner's top-K
  (`ScheduleVerifyLensTopk.execute`) then returns exactly those lengths (as `1 + l`, clamped to
  the configured verify range) when it is asked for that same budget on those confidences. Upstream's tensor-parallel sync of the lengths, its budget invariant and its debug
  log run on them unchanged. A different budget (`--speculative-dspark-align-verify-tokens-
  to-graph-tier` raises it to fill a CUDA-graph tier) is left to upstream's top-K, which then
  fills the tier from the same survival order.
- `dspark_sps_startup`: with a scheduling mode and no `--speculative-dspark-sps-table-path`,
  the round's cost (SGLang's additive table: the target's own verify forward by batch tokens,
  the DSpark draft pass by requests) is profiled at start-up and cached on disk
  (sglang_dspark.scheduling.sps); `SGLANG_DSPARK_SPS_PROFILE=0` keeps upstream's flat table. Under
  tensor parallelism every rank runs the profile's forwards, rank 0's cache read and timings
  are broadcast over the TP CPU group, so every rank schedules with one table.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time

from sglang_dspark.plugin import cpu_gemm, parallel
from sglang_dspark.plugin.registry import register_after, register_around, register_before

logger = logging.getLogger(__name__)

SCHEDULER_ENV = "SGLANG_DSPARK_SCHEDULER"
RAGGED_ENV = "SGLANG_RAGGED_VERIFY_MODE"
MODES = {"static": "static", "async": "compact", "sync": "compact"}
# A DSPARK launch with neither variable set, by device (the chart's profiles agree: tested).
DEFAULT_MODES = {"cpu": "sync", "cuda": "async"}


def default_mode(device: str | None) -> str:
    """The scheduler mode a DSPARK launch on ``device`` gets when none is asked for: sync on
    the CPU, async (overlap scheduling kept) on CUDA and any other accelerator."""
    kind = str(device or "cuda").split(":", 1)[0]
    return DEFAULT_MODES.get(kind, "async")


class SchedulerConfigError(ValueError):
    pass


def scheduler_mode(environ: dict[str, str] | None = None) -> str | None:
    """The validated SGLANG_DSPARK_SCHEDULER value, or None when unset."""
    env = os.environ if environ is None else environ
    raw = env.get(SCHEDULER_ENV, "").strip().lower()
    if not raw:
        return None
    if raw not in MODES:
        raise SchedulerConfigError(
            f"{SCHEDULER_ENV}={raw!r} is not one of {', '.join(MODES)}; unset it for "
            "upstream's behaviour."
        )
    return raw


def apply_mode_env(
    environ: dict[str, str] | None = None, *, default: str | None = None
) -> str | None:
    """Set SGLANG_RAGGED_VERIFY_MODE from the scheduler mode (before SGLang reads it).

    `default` is the mode written to SGLANG_DSPARK_SCHEDULER when neither variable is set.
    Raises when both are set and disagree, rather than silently picking one.
    """
    env = os.environ if environ is None else environ
    if default is not None and not env.get(SCHEDULER_ENV, "").strip() and not env.get(RAGGED_ENV):
        env[SCHEDULER_ENV] = default
    raw = scheduler_mode(env)
    if raw is None:
        return None
    want = MODES[raw]
    have = env.get(RAGGED_ENV)
    if have and have != want:
        raise SchedulerConfigError(
            f"{SCHEDULER_ENV}={raw} needs {RAGGED_ENV}={want}, but {RAGGED_ENV}={have} is set; "
            f"unset {RAGGED_ENV} (the scheduler mode sets it)."
        )
    env[RAGGED_ENV] = want
    return raw


# ------------------------------------------------------------------------- mode / overlap
def launch_device(server_args) -> str:
    """The device a launch runs on (SGLang resolves an omitted --device before this hook)."""
    device = getattr(server_args, "device", None)
    if device:
        return str(device)
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _handle_dspark_with_mode(server_args):
    # raises SchedulerConfigError for a bad or conflicting setting
    mode = apply_mode_env(default=default_mode(launch_device(server_args)))
    if mode == "sync":
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(
            server_args, f"sglang-dspark {SCHEDULER_ENV}=sync", disable_overlap_schedule=True
        )
        logger.info(
            "%s=sync: overlap scheduling turned off so each step's verify budget reads that "
            "step's confidences (Algorithm 1 needs the current drafts' survival).",
            SCHEDULER_ENV,
        )


def install_mode() -> None:
    try:
        apply_mode_env()  # early, so every process SGLang starts inherits the verify mode
    except SchedulerConfigError:
        pass  # reported by server-argument resolution below, where the user sees it
    register_before(
        "sglang.srt.arg_groups.speculative_hook._handle_dspark", _handle_dspark_with_mode
    )


# ------------------------------------------------------------------------- sync budget
_warned_overlap = False


def _compute_budget_sync(
    original, planner, *, confidence, generation, current_generation, req_pool_indices_cpu
):
    if scheduler_mode() != "sync" or planner.forced_budget_frac is not None:
        return original(
            planner,
            confidence=confidence,
            generation=generation,
            current_generation=current_generation,
            req_pool_indices_cpu=req_pool_indices_cpu,
        )
    global _warned_overlap
    import torch
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.speculative.dspark_components.dspark_planner import VerifyBudgetDecision

    from sglang_dspark.scheduling.scheduler import expected_throughput, schedule_sync

    try:
        overlap = not get_schedule().disable_overlap_schedule
    except ValueError:  # no published schedule config (outside a server process)
        overlap = False
    if overlap and not _warned_overlap:
        _warned_overlap = True
        logger.warning(
            "%s=sync with overlap scheduling on: the budget reads relayed "
            "confidences, not the current ones",
            SCHEDULER_ENV,
        )
    c = confidence.detach().to("cpu", dtype=torch.float64)
    max_len = planner.cfg.resolved_max_verify_len() - 1  # drafts besides the anchor
    c = c[:, :max_len]
    lengths = schedule_sync(c, planner.sps_table)
    budget = int(lengths.sum())
    theta = expected_throughput(c, lengths, planner.sps_table)
    planner.last_decision = VerifyBudgetDecision(budget=budget, predicted_theta=theta)
    if not overlap:  # under overlap these confidences are relayed ones, not this step's
        carry_lengths(confidence, budget, lengths)
        box = _step_box.get()
        if box is not None:
            box.update(budget=budget, lengths=lengths)
    return budget


SYNC_ATTR = "dspark_sync"  # (budget, lengths) on a step's confidence tensor
# Set by the compute_budget_sync hook for the duration of one call: where the budget planner,
# which sees only a CPU copy of the step's confidences, leaves that step's lengths.
_step_box: contextvars.ContextVar[dict | None] = contextvars.ContextVar("dspark_step", default=None)


def carry_lengths(confidence, budget: int, lengths) -> None:
    """Algorithm 1's ``lengths`` for ``budget``, carried by the step's confidence tensor."""
    setattr(confidence, SYNC_ATTR, (int(budget), lengths))


def _budget_sync_on_step(original, verify_planner, *, confidence, prefix_lens, req_pool_indices):
    """The step's budget; Algorithm 1's lengths onto the step's own confidence tensor (the
    budget planner saw a CPU copy of it on a GPU)."""
    box: dict = {}
    token = _step_box.set(box)
    try:
        budget = original(verify_planner, confidence=confidence, prefix_lens=prefix_lens,
                          req_pool_indices=req_pool_indices)  # fmt: skip
    finally:
        _step_box.reset(token)
    if box and budget is not None and box["budget"] == int(budget):
        carry_lengths(confidence, box["budget"], box["lengths"])
    return budget


def sync_verify_lens(lengths, cfg):
    """SGLang's verify_lens (anchor included) for Algorithm 1's draft counts `lengths`."""
    import torch

    lower = max(int(cfg.min_verify_len), 1)
    return torch.clamp(1 + lengths.to(torch.int64), min=lower, max=cfg.resolved_max_verify_len())


def _topk_with_sync_lengths(original, cls, *args, **kwargs):
    confidence = kwargs.get("confidence")
    budget, lengths = getattr(confidence, SYNC_ATTR, None) or (None, None)
    if (
        budget is not None
        and not args
        and kwargs.get("budget") == budget
        and int(confidence.shape[0]) == int(lengths.shape[0])
    ):
        import torch

        return sync_verify_lens(lengths, kwargs["cfg"]).to(torch.int32)
    return original(cls, *args, **kwargs)


def install_sync_budget() -> None:
    register_around(
        "sglang.srt.speculative.dspark_components.dspark_planner."
        "HostConfidenceBudgetPlanner.compute_budget",
        _compute_budget_sync,
    )
    register_around(
        "sglang.srt.speculative.dspark_components.dspark_planner."
        "DSparkVerifyPlanner.compute_budget_sync",
        _budget_sync_on_step,
    )
    register_around(
        "sglang.kernels.ops.speculative.dspark.dspark_schedule.ScheduleVerifyLensTopk.execute",
        _topk_with_sync_lengths,
    )


# ------------------------------------------------------------------------- SPS at start-up
# The DSPARK worker builds its verify planner (and asks for the SPS table) before the target's
# memory pool, attention backend and eager runner exist. A cached table is returned at once;
# otherwise the planner gets a provisional two-probe table (so it does not fall back to
# verify-all) and the real profile runs in two parts before the server accepts requests:
# the verify sweep right after the target's graphs/eager runner are set up, the draft pass
# right after the drafter's (ModelRunner.init_cuda_graphs runs for both, target first). The
# verify-only table is installed at once; the full one replaces it and is cached.
_planner_ctx: dict = {}
_pending: list[dict] = []


def _planner_init(original, planner, *args, **kwargs):
    _planner_ctx.clear()
    _planner_ctx["runner"] = kwargs.get("model_runner")
    _planner_ctx["draft"] = {k: kwargs.get(k) for k in ("draft_model", "gamma", "tp_sync")}
    try:
        result = original(planner, *args, **kwargs)
        job = _planner_ctx.get("pending")
        if job is not None:
            job["planner"] = planner
            _pending.append(job)
        return result
    finally:
        _planner_ctx.clear()


def sps_key_for(model_runner, *, verify_num_draft_tokens: int, max_requests: int):
    import sglang
    import torch

    from sglang_dspark.scheduling import sps

    sa = model_runner.server_args
    return sps.SpsKey(
        model=os.path.realpath(sa.model_path),
        model_config_sha=sps.config_sha(sa.model_path),
        dtype=str(model_runner.dtype).replace("torch.", ""),
        device=_device_name(model_runner.device),
        attention_backend=str(sa.attention_backend),
        tp_size=int(sa.tp_size),
        threads=torch.get_num_threads(),
        sglang_version=sglang.__version__,
        torch_version=torch.__version__,
        max_requests=int(max_requests),
        verify_tokens=tuple(sps.verify_token_probes(max_requests, verify_num_draft_tokens)),
        draft_requests=tuple(sps.draft_request_probes(max_requests)),
        gemm=cpu_gemm.describe(model_runner.dtype, model_runner.device),
    )


def _device_name(device) -> str:
    import platform

    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    return f"{dev.type}:{platform.processor() or platform.machine()}:{os.cpu_count()}cpu"


def _build_sps_table(original, *, verify_num_draft_tokens):
    from sglang.srt.runtime_context import get_schedule, get_spec
    from sglang.srt.speculative.dspark_components.dspark_sps import SpsCostTable

    runner = _planner_ctx.get("runner")
    if (
        get_spec().speculative_dspark_sps_table_path
        or runner is None
        or os.environ.get("SGLANG_DSPARK_SPS_PROFILE", "1") == "0"
    ):
        return original(verify_num_draft_tokens=verify_num_draft_tokens)
    from sglang_dspark.scheduling import sps

    max_requests = int(get_schedule().max_running_requests or 1)
    key = sps_key_for(
        runner, verify_num_draft_tokens=verify_num_draft_tokens, max_requests=max_requests
    )
    group = parallel.tp_cpu_group()
    # rank 0 reads the cache and every rank takes its answer: a rank that profiled while
    # another read a table would wait forever in the profile's collectives
    table = sps.agree(sps.load_cached(key) if parallel.tp_rank() == 0 else None, group)
    if table is not None:
        logger.info("DSpark SPS table read from %s: %s", sps.cache_path(key), sps.describe(table))
        return table
    _planner_ctx["pending"] = {
        "runner": runner,
        "key": key,
        "group": group,
        "max_requests": max_requests,
        "verify_num_draft_tokens": verify_num_draft_tokens,
        **_planner_ctx.get("draft", {}),
    }
    top = max_requests * verify_num_draft_tokens
    return SpsCostTable(
        sample_batch_tokens=[1, top], sample_steps_per_sec=[1.0, 1.0], max_batch_tokens=top
    )


def _profile_after_graphs(result, model_runner, *args, **kwargs):
    """Target runner: time the verify sweep, install the verify-only table. Draft runner (next):
    time the draft pass, install and cache the full table."""
    from sglang_dspark.scheduling import sps

    if getattr(model_runner, "is_draft_worker", False):
        jobs = [j for j in _pending if "verify" in j]
        if jobs:
            _finish_with_draft(jobs[0], model_runner)
        return
    for job in [j for j in _pending if j["runner"] is model_runner and "verify" not in j]:
        t0, cpu0 = time.perf_counter(), time.process_time()
        timings = sps.profile_verify(
            model_runner,
            verify_num_draft_tokens=job["verify_num_draft_tokens"],
            max_requests=job["max_requests"],
        )
        job["verify"] = sps.agree(timings, job.get("group"))  # rank 0's, on every rank
        job["seconds"] = time.perf_counter() - t0
        job["cpu_share"] = sps.agree(
            sps.cpu_share(time.process_time() - cpu0, job["seconds"], model_runner.device),
            job.get("group"),
        )
        _install(job, sps.additive_table_from_timings(job["verify"]))
        if job.get("draft_model") is None:  # nothing to time the draft pass with
            _finish_with_draft(job, None)


def _finish_with_draft(job: dict, draft_runner) -> None:
    from sglang.srt.environ import envs

    from sglang_dspark.scheduling import sps

    _pending.remove(job)
    t0 = time.perf_counter()
    draft = None
    if draft_runner is not None:
        try:
            draft = sps.profile_draft(
                draft_runner,
                job["draft_model"],
                gamma=int(job["gamma"]),
                max_requests=job["max_requests"],
                tp_sync=job["tp_sync"],
                greedy_draft=bool(envs.SGLANG_DSPARK_USE_GREEDY_DRAFT.get()),
            )
        except Exception as e:  # noqa: BLE001 - a drafter we cannot time must not stop serving
            logger.warning("DSpark SPS: the draft pass could not be timed (%r); alpha = 0", e)
    draft = sps.agree(draft, job.get("group"))
    table = sps.additive_table_from_timings(job["verify"], draft)
    seconds = job["seconds"] + time.perf_counter() - t0
    busy = sps.busy_reason(job.get("cpu_share"))
    if busy:  # used for this run, never cached: a contended profile must not outlive it
        path = sps.save_cached(
            job["key"], table, seconds=seconds, busy=True, cpu=job.get("cpu_share")
        )
        logger.warning(
            "DSpark SPS: %s, so the timings are inflated and the scheduler will under-verify; "
            "the table is used for this run only and not cached. Restart on a quiet machine to "
            "profile again (or pass --speculative-dspark-sps-table-path).",
            busy,
        )
    elif parallel.tp_rank() == 0:
        path = sps.save_cached(job["key"], table, seconds=seconds, cpu=job.get("cpu_share"))
    else:
        path = sps.cache_path(job["key"])  # rank 0 writes it
    _install(job, table)
    logger.info(
        "DSpark SPS table profiled at start-up in %.1f s, %s %s: %s",
        seconds,
        "not cached (contended), written to" if busy else "cached at",
        path,
        sps.describe(table),
    )


def _install(job: dict, table) -> None:
    budget_planner = getattr(job["planner"], "_budget_planner", None)
    if budget_planner is not None:
        budget_planner.sps_table = table


def install_sps_startup() -> None:
    register_around(
        "sglang.srt.speculative.dspark_components.dspark_planner.DSparkVerifyPlanner.__init__",
        _planner_init,
    )
    register_around(
        "sglang.srt.speculative.dspark_components.dspark_planner.build_sps_cost_table",
        _build_sps_table,
    )
    register_after(
        "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs",
        _profile_after_graphs,
    )


HOOKS = {
    "dspark_scheduler_mode": install_mode,
    "dspark_sync_scheduler": install_sync_budget,
    "dspark_sps_startup": install_sps_startup,
}
