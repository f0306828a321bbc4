"""SPS(B): engine steps per second at B verify batch tokens, profiled where the engine runs.

The scheduler (scheduler.py, DSPARK.md section 3) maximises Theta = tau * SPS(B); with no
table SGLang 0.5.23 uses a flat one and scheduling gains nothing. The plugin therefore
profiles at engine start-up (`profile_verify` once the target's eager runner exists,
`profile_draft` once the drafter's does, both before the server accepts requests), unless
`--speculative-dspark-sps-table-path` is given. The result is SGLang's `SpsAdditiveCostTable`,
the cost of one decode round:

    step_time(R, B) = bias + alpha(R) + theta(B)        SPS(B) = 1 / step_time, B = R + budget

- theta(m): the target's TARGET_VERIFY forward at m batch tokens (SGLang's own dummy verify
  batch, the one its warm-up uses) minus its value at one token, for m at every token count
  up to 2 (gamma + 1) and on a coarser grid up to R_max (gamma + 1), each m timed with the
  fewest requests that produce it (the shape compact verify has when windows are trimmed);
  SGLang interpolates linearly between probes, so SPS is a smooth curve, not a staircase.
- bias: that one-token verify forward, the part of the round no verify budget changes.
- alpha(R): the DSpark draft pass for R requests, which every round pays before it verifies:
  the drafter backbone over R blocks (the draft runner's own dummy TARGET_VERIFY forward),
  the shared LM head on gamma positions per request, the gamma Markov steps and the
  confidence head (the proposer's own functions, on the backbone's hidden-state shape).
  Timed at start-up rather than from the first live rounds: the table is then complete before
  the first request, deterministic for the cache key, and covers every R, not only the
  concurrencies that happened to arrive first. Not priced: the per-request scheduler and
  accept/commit work outside the forwards. Measured live on the embedded CPU server (verify
  trace, 16 requests), whole rounds cost 1.61x the table at B = 128 (static, 339 against 211
  ms) and 1.68x at B = 48 (sync, 224 against 133 ms): close to one constant factor, which
  leaves Algorithm 1's choice (an argmax of tokens / step time) unchanged, so no per-request
  term is added.

Timings are medians of repeats, made non-decreasing in m and in R by isotonic regression
(noise must not tell the scheduler that verifying more is free). The table is cached on disk under
`<cache>/sps/<key>.json`, keyed by model (path and config.json), dtype, device, attention
backend, tensor parallel size, threads, sglang and torch versions, the probes and
TABLE_VERSION; `<key>.table.json` beside it is the bare table, in SGLang's own format
(`--speculative-dspark-sps-table-path` reads it).

Under tensor parallelism every rank runs the profile (its forwards have collectives) and
rank 0's timings and cache read are broadcast (`agree`), so every rank holds the same table;
only rank 0 writes the cache.

Offline: `sglang-dspark sps profile` starts the embedded server once (which profiles and
fills the cache) and prints the table; `sglang-dspark sps plot TABLE.json --out sps.png`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sglang.srt.speculative.dspark_components.dspark_sps import (
    SpsAdditiveCostTable,
    SpsCostTable,
)

from sglang_dspark.serving.cache import cache_dir

logger = logging.getLogger(__name__)

# 3: the CPU verify attention became one batched SDPA per layer (old tables timed the per-request loop)
# 4: additive table (bias + alpha(R) draft pass + theta(m) interpolated verify), dense m probes
TABLE_VERSION = 4

SpsTable = SpsCostTable | SpsAdditiveCostTable


@dataclass(frozen=True)
class SpsKey:
    """Everything an SPS table depends on; its hash names the cache file."""

    model: str  # resolved model path
    model_config_sha: str  # sha256 of config.json (same path, different model: new table)
    dtype: str
    device: str
    attention_backend: str
    tp_size: int
    threads: int  # torch intra-op threads (CPU step time depends on them)
    sglang_version: str
    torch_version: str
    max_requests: int
    verify_tokens: tuple[int, ...]  # theta probes m
    draft_requests: tuple[int, ...]  # alpha probes R
    gemm: str = "native"  # CPU half-precision GEMM path (`cpu_gemm.describe`)
    version: int = TABLE_VERSION

    def digest(self) -> str:
        raw = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(raw).hexdigest()[:16]


def sps_cache_dir() -> Path:
    return cache_dir() / "sps"


def cache_path(key: SpsKey) -> Path:
    return sps_cache_dir() / f"{key.digest()}.json"


def config_sha(model_path: str | Path) -> str:
    cfg = Path(model_path) / "config.json"
    return hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.is_file() else "none"


# --------------------------------------------------------------------------------------------
# Probes


def verify_token_probes(max_requests: int, verify_num_draft_tokens: int) -> list[int]:
    """Batch-token counts m at which theta is timed: every m up to 2 (gamma + 1) (where one or
    two requests decide draft by draft), then 2^i and 3 2^(i-1) (24, 32, 48, 64, 96, ...) up to
    R_max (gamma + 1), which is always included. Only m that R requests of k <= gamma + 1
    tokens each make (R k = m) with R at most twice the fewest requests that can hold m (a
    prime m = 11 would be 11 one-token requests: interpolated instead)."""
    k_max = verify_num_draft_tokens
    top = max_requests * k_max
    grid = set(range(1, 2 * k_max + 1)) | {top}
    x = 16
    while x <= top:
        grid.update((x, x + x // 2))
        x *= 2
    keep = []
    for m in sorted(x for x in grid if x <= top):
        shape = verify_shape(m, max_requests, k_max)
        if shape is not None and (m == top or shape[0] <= 2 * -(-m // k_max)):
            keep.append(m)
    return keep


def verify_shape(m: int, max_requests: int, k_max: int) -> tuple[int, int] | None:
    """(R, k) with R k = m, k <= k_max, R <= max_requests and R the smallest, or None."""
    for r in range(max(1, -(-m // k_max)), max_requests + 1):
        if m % r == 0 and m // r <= k_max:
            return r, m // r
    return None


def draft_request_probes(max_requests: int) -> list[int]:
    """R at which the draft pass alpha(R) is timed: 1, 2, 4, ... and R_max (it is close to
    linear in R; SGLang interpolates between probes)."""
    return sorted(
        {max_requests} | {2**i for i in range(max_requests.bit_length()) if 2**i <= max_requests}
    )


# --------------------------------------------------------------------------------------------
# Timings -> table


def _monotone_medians(seconds: dict[int, Sequence[float]]) -> tuple[list[int], list[float]]:
    """Sorted keys and their median seconds, made non-decreasing by isotonic regression (pool
    adjacent violators: a run that goes down is replaced by its mean), the least-squares
    non-decreasing fit; a slow outlier is averaged with what follows it, not carried forward
    as a running maximum would."""
    xs = sorted(seconds)
    blocks: list[list[float]] = []  # [sum, count] per pooled run
    for x in xs:
        blocks.append([statistics.median(seconds[x]), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    ys = [total / count for total, count in blocks for _ in range(int(count))]
    return xs, ys


def additive_table_from_timings(
    verify_seconds: dict[int, Sequence[float]],
    draft_seconds: dict[int, Sequence[float]] | None = None,
) -> SpsAdditiveCostTable:
    """Verify forward times by batch tokens m and draft pass times by requests R
    => `SpsAdditiveCostTable` with bias = verify(m_min), theta(m) = verify(m) - bias,
    alpha(R) = draft(R) (zero when no draft timings are given)."""
    if not verify_seconds:
        raise ValueError("no verify timings to build an SPS table from")
    ms, verify = _monotone_medians(verify_seconds)
    bias = max(verify[0], 1e-9)
    if draft_seconds:
        rs, alpha = _monotone_medians(draft_seconds)
    else:
        rs, alpha = [1], [0.0]
    return SpsAdditiveCostTable(
        bias_seconds=bias,
        bs_probes=rs,
        alpha_seconds=alpha,
        m_probes=ms,
        theta_seconds=[v - bias for v in verify],
    )


def step_seconds(table: SpsTable, *, num_reqs: int, batch_tokens: int) -> float:
    """One round's predicted seconds at R requests and B batch tokens, as SGLang prices it."""
    if isinstance(table, SpsAdditiveCostTable):
        return table.step_time(num_reqs=num_reqs, budget=batch_tokens - num_reqs)
    return 1.0 / table.lookup(batch_tokens)


def time_calls(
    run: Callable[[int], None],
    points: Sequence[int],
    *,
    repeats: int = 3,
    warmup: int = 1,
    sync: Callable[[], None] = lambda: None,
) -> dict[int, list[float]]:
    """Call run(x) `warmup + repeats` times per point; wall seconds per call, by point.

    Sweeps are interleaved (warm-up sweeps, then `repeats` timed sweeps over every point), so
    a burst of load from another process on a shared machine lands on one repeat of many
    points, which their medians drop, rather than on every repeat of one point."""
    for _ in range(warmup):
        for x in points:
            run(x)
    sync()
    out: dict[int, list[float]] = {x: [] for x in points}
    for _ in range(repeats):
        for x in points:
            t0 = time.perf_counter()
            run(x)
            sync()
            out[x].append(time.perf_counter() - t0)
    return out


# --------------------------------------------------------------------------------------------
# Profiling the live engine (called by the plugin in the scheduler process)


def _device_sync(device) -> Callable[[], None]:
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return lambda: None
    return lambda: torch.get_device_module(device).synchronize()


def _dummy_forward(model_runner, max_requests: int, tokens_per_request: int):
    """run(R, k): SGLang's dummy TARGET_VERIFY forward of `model_runner` (its warm-up path) for
    R requests of k tokens, on one buffer set; `restore()` undoes the overrides.

    The warm-up dummy is built for full windows: its spec input (`create_dummy_verify_input`)
    says `draft_token_num = speculative_num_draft_tokens` and carries no ragged layout. A backend
    that sizes the verify from the batch's tokens (torch_native, `_window_lens`) runs any k that
    way, but one that reads the spec input does not: DeepSeek-V4's (`deepseek_v4_backend.py`)
    expands a layout-less verify to `speculative_num_draft_tokens` tokens per request
    (`init_forward_metadata_target_verify`), 6 against the R k out-cache-locs the buffers hold
    (`init_compression_metadata`'s assert, `raw_out_loc.shape=1, num_tokens=6` at m = 1), and
    sizes a DSpark draft block by `draft_token_num`. So the dummy batch is given, through
    `ModelRunner.prepare_dummy_forward_batch` (the hook SGLang calls on a runner-created dummy
    batch before attention metadata), what the engine's own batches carry:

    - target, `SGLANG_RAGGED_VERIFY_MODE=compact` (the `sync` and `async` schedulers): a
      `RaggedVerifyLayout` of R windows of k tokens, built as the planner builds an eager
      step's (`RaggedVerifyLayout.from_verify_lens`, grid = the total: no CUDA-graph tier), so
      the timed path is compact ragged verify. Other modes verify whole windows: no layout.
    - draft: `draft_token_num = k`, the block the DSpark worker's own spec input gives the
      drafter (`make_draft_block_spec_info(draft_token_num=query_token_num)`).

    Dense models on torch_native time the same forward as before (the layout's lengths are the
    uniform ones `_window_lens` derived from the token count)."""
    import torch
    from sglang.srt.speculative.ragged_verify import (
        RaggedVerifyLayout,
        RaggedVerifyMode,
        read_ragged_verify_mode,
    )

    runner = getattr(model_runner, "eager_runner", None)
    if runner is None:
        raise RuntimeError(
            "the model runner has no eager runner yet; profile after init_cuda_graphs"
        )
    backend = model_runner.attn_backend
    try:
        backend.get_cuda_graph_seq_len_fill_value()
    except NotImplementedError:  # e.g. torch_native (CPU): dummy requests of length 1
        backend.get_cuda_graph_seq_len_fill_value = lambda: 1
    try:
        buffers = runner._alloc_dummy_decode_buffers(
            max_requests, num_tokens_per_req=tokens_per_request, allocate_logits_buffer=False
        )
    finally:
        if "get_cuda_graph_seq_len_fill_value" in vars(backend):
            del backend.get_cuda_graph_seq_len_fill_value

    is_draft = bool(getattr(model_runner, "is_draft_worker", False))
    compact = not is_draft and read_ragged_verify_mode() is RaggedVerifyMode.COMPACT
    prepare = model_runner.prepare_dummy_forward_batch  # SGLang's (bound), kept under ours
    layouts: dict[tuple[int, int], RaggedVerifyLayout] = {}
    shape = [0, 0]  # (R, k) of the forward being run

    def layout(r: int, k: int) -> RaggedVerifyLayout:
        if (r, k) not in layouts:  # built once per shape (the warm-up sweep), not timed
            layouts[r, k] = RaggedVerifyLayout.from_verify_lens(
                verify_lens_cpu=[k] * r, device=model_runner.device, grid=[r * k]
            )
        return layouts[r, k]

    def prepare_like_the_engine(forward_batch):
        forward_batch = prepare(forward_batch)
        spec = forward_batch.spec_info
        r, k = shape
        if spec is not None and is_draft:
            spec.draft_token_num = spec.num_tokens_per_req = k
            spec.num_tokens_for_logprob_per_req = k
        elif spec is not None and compact:
            spec.ragged_verify_layout = layout(r, k)
        return forward_batch

    def run(r: int, k: int) -> None:
        shape[:] = r, k
        model_runner.decode_num_tokens_per_req = lambda *a, **kw: k
        model_runner.prepare_dummy_forward_batch = prepare_like_the_engine
        with torch.inference_mode():
            runner._dummy_run(batch_size=r, buffers=buffers)

    def restore() -> None:
        for name in ("decode_num_tokens_per_req", "prepare_dummy_forward_batch"):
            if name in vars(model_runner):
                delattr(model_runner, name)

    return run, restore


def _output_rows(model_runner, run: Callable[[], None]):
    """The hidden states `model_runner.model.forward` returns during `run()` (one forward)."""
    model = model_runner.model
    forward, seen = model.forward, []

    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out.hidden_states)
        return out

    model.forward = spy  # an instance attribute: `_dummy_run` calls `mr.model.forward(...)`
    try:
        run()
    finally:
        del model.forward
    if not seen or seen[0] is None:
        raise RuntimeError("the draft backbone's dummy forward returned no hidden states")
    return seen[0]


def profile_verify(
    model_runner, *, verify_num_draft_tokens: int, max_requests: int, repeats: int = 3
) -> dict[int, list[float]]:
    """Seconds of the target's TARGET_VERIFY forward by batch tokens m."""
    ms = verify_token_probes(max_requests, verify_num_draft_tokens)
    run, restore = _dummy_forward(model_runner, max_requests, verify_num_draft_tokens)
    shapes = {m: verify_shape(m, max_requests, verify_num_draft_tokens) for m in ms}
    try:
        return time_calls(
            lambda m: run(*shapes[m]), ms, repeats=repeats, sync=_device_sync(model_runner.device)
        )
    finally:
        restore()


def profile_draft(
    draft_runner,
    draft_model,
    *,
    gamma: int,
    max_requests: int,
    tp_sync,
    greedy_draft: bool = False,
    repeats: int = 3,
) -> dict[int, list[float]]:
    """Seconds of the DSpark draft pass by requests R, in the worker's own pieces, as
    `DraftBlockProposer.propose` runs them when the draft is not folded into a graph (CPU):
    the draft runner's dummy TARGET_VERIFY forward over R blocks (backbone, reading the
    injected context KV), then `compute_base_logits` (the shared LM head on R gamma rows),
    `sample_draft_block` (gamma Markov steps, greedy rows) and `compute_confidence`. The
    Markov noise is a private stream, so the server's draft randomness is untouched."""
    import torch
    from sglang.srt.speculative.dspark_components.dspark_draft import (
        DraftNoise,
        sample_draft_block,
    )

    q = gamma if draft_model.sample_from_anchor else gamma + 1
    device = torch.device(draft_runner.device)
    run_backbone, restore = _dummy_forward(draft_runner, max_requests, q)
    try:
        # the rows compute_base_logits takes are the backbone's own output rows: [hidden] for
        # a dense drafter, [hc_mult, hidden] for DeepSeek-V4's (collapsed by its hc head)
        row = _output_rows(draft_runner, lambda: run_backbone(1, q))
    except BaseException:
        restore()
        raise
    feats = torch.randn(max_requests * gamma, *row.shape[1:], dtype=row.dtype, device=device)
    anchors = torch.zeros(max_requests, dtype=torch.long, device=device)
    noise = DraftNoise(key=0, offset=torch.zeros(1, dtype=torch.int64, device=device))

    def run(r: int) -> None:
        run_backbone(r, q)
        with torch.inference_mode():
            x = feats[: r * gamma]
            base_logits, conf_features = draft_model.compute_base_logits(x)
            block = sample_draft_block(
                base_logits=base_logits.view(r, gamma, -1),
                anchor_tokens=anchors[:r],
                draft_hidden=x.view(r, gamma, -1),
                sampling_info=None,
                markov_head=draft_model.markov_head,
                noise=noise,
                device=device,
                tp_sync=tp_sync,
                greedy_draft=greedy_draft,
            )
            if draft_model.confidence_head is not None:
                draft_model.compute_confidence(
                    anchor_tokens=anchors[:r],
                    draft_tokens=block.draft_tokens,
                    confidence_features=conf_features,
                )

    try:
        return time_calls(
            run, draft_request_probes(max_requests), repeats=repeats, sync=_device_sync(device)
        )
    finally:
        restore()


def cpu_share(cpu_seconds: float, wall_seconds: float, device) -> dict | None:
    """How much of the machine the profile got: this process's CPU seconds per wall second,
    against the threads torch may use. None off the CPU (there the host mostly waits)."""
    import os

    import torch

    if torch.device(device).type != "cpu" or wall_seconds <= 0:
        return None
    threads = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))
    return {"cores_used": round(cpu_seconds / wall_seconds, 3), "threads": threads,
            "load_avg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip


# The plugin's start-up log line naming the table's file (profiled, contended, or read).
STARTUP_LINE = re.compile(
    r"DSpark SPS table (?:profiled at start-up in [0-9.]+ s, (?:cached at|not cached "
    r"\(contended\), written to)|read from) (\S+):"
)

# below this share of its threads the profile was fighting other processes for the cores
MIN_CPU_SHARE = 0.6


def busy_reason(share: dict | None) -> str | None:
    """Why a CPU profile's timings cannot be trusted (another process held the cores), or None."""
    if not share:
        return None
    if share["cores_used"] < MIN_CPU_SHARE * share["threads"]:
        return (
            f"the profile got {share['cores_used']:.2f} of its {share['threads']} threads' cores "
            f"(1-minute load average {share['load_avg_1m']})"
        )
    return None


def table_from_json(data: str) -> SpsTable:
    """Either SGLang table from its JSON, told apart as SGLang's loader does."""
    if '"bias_seconds"' in data:
        return SpsAdditiveCostTable.from_json(data)
    return SpsCostTable.from_json(data)


def load_cached(key: SpsKey) -> SpsTable | None:
    path = cache_path(key)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        return table_from_json(json.dumps(raw["table"]))
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable SPS cache %s (%s); profiling again", path, e)
        return None


def save_cached(
    key: SpsKey, table: SpsTable, *, seconds: float, busy: bool = False, cpu: dict | None = None
) -> Path:
    """Write `<key>.json` ({"key", "table", "profile_seconds", "cpu"}) and `<key>.table.json`
    (the bare table, what `--speculative-dspark-sps-table-path` takes), atomically. `busy`: a
    profile taken on a contended machine goes to `<key>.busy.json` only, which is never read
    back (kept to look at)."""
    path = busy_path(key) if busy else cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    table_json = json.loads(table.to_json())
    record = {"key": asdict(key), "table": table_json, "profile_seconds": round(seconds, 3),
              "cpu": cpu}  # fmt: skip
    targets = [(path, record)] if busy else [(path, record), (bare_table_path(key), table_json)]
    for target, payload in targets:
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(json.dumps(payload, indent=1))
        tmp.replace(target)
    return path


def busy_path(key: SpsKey) -> Path:
    return sps_cache_dir() / f"{key.digest()}.busy.json"


def bare_table_path(key: SpsKey) -> Path:
    return sps_cache_dir() / f"{key.digest()}.table.json"


def agree(value, group=None):
    """Rank 0's `value` on every rank of the process group `group` (a CPU/gloo group, e.g.
    SGLang's `tp_group.cpu_group`); `value` itself without a group or on one rank.

    Under tensor parallelism every rank runs the profile's forwards in lockstep (their
    collectives need all ranks), but each would time its own: the budget code assumes one
    replicated table, so only rank 0's timings, and rank 0's cache read, count."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def describe(table: SpsTable) -> str:
    """One log line: the terms in milliseconds."""
    if isinstance(table, SpsCostTable):
        return (
            f"B={table.sample_batch_tokens} "
            f"steps/s={[round(x, 2) for x in table.sample_steps_per_sec]}"
        )
    ms = lambda xs: [round(1e3 * x, 1) for x in xs]
    return (
        f"bias={1e3 * table.bias_seconds:.1f} ms, alpha(R) ms at R={table.bs_probes}: "
        f"{ms(table.alpha_seconds)}, theta(m) ms at m={table.m_probes}: {ms(table.theta_seconds)}"
    )


def plot_table(
    table: SpsTable, out: str | Path, *, title: str = "SPS(B)", requests: Sequence[int] = (1, 4, 16)
) -> Path:
    """An `SpsAdditiveCostTable`: its two terms (verify bias + theta(m), draft alpha(R)) and
    SPS(B) = 1 / step_time at a few request counts R; an `SpsCostTable`: its floor steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(table, SpsCostTable):
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        xs, ys = table.sample_batch_tokens, table.sample_steps_per_sec
        ax.step(xs, ys, where="post", marker="o", label="steps/s (floor lookup)")
        ax.set_xlabel("verify batch tokens B")
        ax.set_ylabel("engine steps per second")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(title)
    else:
        fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(13.5, 4.0))
        ms = table.m_probes
        a1.plot(ms, [1e3 * (table.bias_seconds + t) for t in table.theta_seconds], marker=".")
        a1.axhline(1e3 * table.bias_seconds, color="grey", ls=":", label="bias")
        a1.set_xlabel("verify batch tokens m")
        a1.set_ylabel("ms")
        a1.set_title("verify forward: bias + theta(m)")
        a1.legend(fontsize=8)
        a2.plot(table.bs_probes, [1e3 * a for a in table.alpha_seconds], marker="o",
                color="tab:green")  # fmt: skip
        a2.set_xlabel("requests R")
        a2.set_ylabel("ms")
        a2.set_title("draft pass: alpha(R)")
        k = max(1, round(ms[-1] / max(table.bs_probes[-1], 1)))  # tokens per request at the top
        for r in requests:
            bs = list(range(r, r * k + 1))
            a3.plot(bs, [b / step_seconds(table, num_reqs=r, batch_tokens=b) for b in bs],
                    label=f"R={r}")  # fmt: skip
        a3.set_xlabel("verify batch tokens B = R + budget")
        a3.set_ylabel("B x SPS(B)  (tokens/s if all accepted)")
        a3.set_xscale("log", base=2)
        a3.set_title("one round, all terms")
        a3.legend(fontsize=8)
        for a in (a1, a2, a3):
            a.grid(True, alpha=0.3)
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------------------------
# CLI: sglang-dspark sps {profile,plot}


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="sps_command", required=True)
    p = sub.add_parser(
        "profile",
        help="start the embedded DSPARK server once (it profiles SPS at start-up into the "
        "cache, or reads the cached table), stop it, print the table, optionally plot it",
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--out", default=None, help="also copy the bare table JSON here")
    p.add_argument("--plot", default=None, help="write the SPS curve as a PNG here")
    p.add_argument("--force", action="store_true", help="drop a cached table first")
    p = sub.add_parser("plot", help="plot an SPS table JSON (SGLang's format) as a PNG")
    p.add_argument("table")
    p.add_argument("--out", required=True)


def run(args) -> int:
    if args.sps_command == "plot":
        from sglang.srt.speculative.dspark_components.dspark_sps import load_sps_table_from_path

        table = load_sps_table_from_path(args.table)
        print(plot_table(table, args.out, title=f"SPS: {Path(args.table).name}"))
        return 0
    return _profile_with_embedded_server(args)


def _profile_with_embedded_server(args) -> int:
    import shutil
    import tempfile

    from sglang_dspark.serving import embedded
    from sglang_dspark.serving.server import SGLangServer, free_port

    paths = embedded.ensure(dtype=args.dtype)
    if args.force:
        for f in sps_cache_dir().glob("*.json"):
            f.unlink()
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"sglang-dspark-sps-{port}.log"
    cmd = embedded.launch_command(paths, port=port, dtype=args.dtype)
    with SGLangServer(cmd, embedded.launch_env(scheduler="sync"), port, log) as server:
        text = server.log_text()
    found = STARTUP_LINE.findall(text)
    if not found:
        raise RuntimeError(f"the server did not report an SPS table; see {log}")
    record = json.loads(Path(found[-1]).read_text())
    table = table_from_json(json.dumps(record["table"]))
    print(f"SPS table {found[-1]} ({record.get('profile_seconds', '?')} s to profile)")
    busy = busy_reason(record.get("cpu"))
    if busy:
        print(f"NOT CACHED: {busy}; the timings are inflated. Run again on a quiet machine.")
    print(describe(table))
    if isinstance(table, SpsAdditiveCostTable):
        top = table.m_probes[-1]
        print(f"{'R':>4} {'B':>5} {'step ms':>8} {'B x steps/s':>12}")
        for r in table.bs_probes:
            for b in sorted({r, 2 * r, top * r // table.bs_probes[-1]}):
                t = step_seconds(table, num_reqs=r, batch_tokens=b)
                print(f"{r:>4} {b:>5} {1e3 * t:>8.1f} {b / t:>12.1f}")
    if busy:
        return 1
    if args.out:
        shutil.copy(Path(found[-1]).with_name(Path(found[-1]).stem + ".table.json"), args.out)
        print(f"wrote {args.out} (--speculative-dspark-sps-table-path)")
    if args.plot:
        print(f"wrote {plot_table(table, args.plot, title='SPS, embedded server')}")
    return 0
