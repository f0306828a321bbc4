"""SPS(B): engine steps per second at B verify batch tokens, profiled where the engine runs.

The scheduler (scheduler.py, DSPARK.md section 3) maximises Theta = tau * SPS(B); with no
table SGLang 0.5.23 uses a flat one and scheduling gains nothing. The plugin therefore
profiles SPS at engine start-up (`profile_model_runner`, called from the DSPARK verify
planner's construction in the scheduler process), unless `--speculative-dspark-sps-table-path`
is given:

- a short sweep of real TARGET_VERIFY forward passes of the loaded target (SGLang's own dummy
  verify batch, the one its warm-up uses) over (requests R, tokens per request k), i.e.
  batch tokens B = R * k. Each B keeps the fewest requests that produce it (the shape compact
  verify has when the scheduler trims windows); its value is 1 / median(seconds per step).
- the table is SGLang's `SpsCostTable` JSON (floor lookup), cached on disk under
  `<cache>/sps/<key>.json`, keyed by model (path and config.json), dtype, device, attention
  backend, tensor parallel size, sglang and torch versions and the sweep itself. The next
  start with the same key reads the file instead of profiling.

Offline: `sglang-dspark sps profile` starts the embedded server once (which profiles and
fills the cache) and prints the table; `sglang-dspark sps plot TABLE.json --out sps.png`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from sglang.srt.speculative.dspark_components.dspark_sps import SpsCostTable

from sglang_dspark.cache import cache_dir

logger = logging.getLogger(__name__)

# 3: the CPU verify attention became one batched SDPA per layer (old tables timed the per-request loop)
TABLE_VERSION = 3


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
    tokens_per_request: tuple[int, ...]
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


def sweep_shapes(max_requests: int, tokens_per_request: Sequence[int]) -> list[tuple[int, int]]:
    """(R, k) pairs to time: R in 1, 2, 4, ... max_requests; for each B = R * k only the
    smallest R (the fewest requests that reach B)."""
    requests = sorted({min(2**i, max_requests) for i in range(max_requests.bit_length() + 1)})
    best: dict[int, tuple[int, int]] = {}
    for r in requests:
        for k in sorted(set(tokens_per_request)):
            b = r * k
            if b not in best or r < best[b][0]:
                best[b] = (r, k)
    return [best[b] for b in sorted(best)]


def table_from_timings(seconds: dict[int, Sequence[float]]) -> SpsCostTable:
    """batch tokens -> repeated step times  =>  SpsCostTable (1 / median), made non-increasing
    in B (a bigger verify batch is never faster; timing noise must not tell the scheduler that
    verifying more is free)."""
    if not seconds:
        raise ValueError("no SPS timings to build a table from")
    xs = sorted(seconds)
    sps = [1.0 / max(statistics.median(seconds[b]), 1e-9) for b in xs]
    for i in range(1, len(sps)):
        sps[i] = min(sps[i], sps[i - 1])
    return SpsCostTable(sample_batch_tokens=xs, sample_steps_per_sec=sps, max_batch_tokens=xs[-1])


def time_sweep(
    run: Callable[[int, int], None],
    shapes: Sequence[tuple[int, int]],
    *,
    repeats: int = 5,
    warmup: int = 1,
    sync: Callable[[], None] = lambda: None,
) -> dict[int, list[float]]:
    """Call run(R, k) `warmup + repeats` times per shape; wall seconds per call, by B."""
    out: dict[int, list[float]] = {}
    for r, k in shapes:
        for _ in range(warmup):
            run(r, k)
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run(r, k)
            sync()
            times.append(time.perf_counter() - t0)
        out[r * k] = times
    return out


def profile_model_runner(
    model_runner, *, verify_num_draft_tokens: int, max_requests: int, repeats: int = 7
) -> SpsCostTable:
    """Time SGLang's dummy TARGET_VERIFY forward of the target over the sweep.

    Uses the eager runner's own `_dummy_run` (the warm-up path) on a fresh buffer set; the
    tokens per request are varied by overriding the runner's `decode_num_tokens_per_req` for
    the duration of the sweep.
    """
    import torch

    runner = getattr(model_runner, "eager_runner", None)
    if runner is None:
        raise RuntimeError(
            "the target model runner has no eager runner yet; profile after init_cuda_graphs"
        )
    ks = tokens_per_request_probes(verify_num_draft_tokens)
    shapes = sweep_shapes(max_requests, ks)
    backend = model_runner.attn_backend
    try:
        backend.get_cuda_graph_seq_len_fill_value()
    except NotImplementedError:  # e.g. torch_native (CPU): dummy requests of length 1
        backend.get_cuda_graph_seq_len_fill_value = lambda: 1
    buffers = runner._alloc_dummy_decode_buffers(
        max_requests, num_tokens_per_req=max(ks), allocate_logits_buffer=False
    )
    if "get_cuda_graph_seq_len_fill_value" in vars(backend):
        del backend.get_cuda_graph_seq_len_fill_value
    original = model_runner.decode_num_tokens_per_req

    def run(r: int, k: int) -> None:
        model_runner.decode_num_tokens_per_req = lambda *a, **kw: k
        with torch.inference_mode():
            runner._dummy_run(batch_size=r, buffers=buffers)

    device = torch.device(model_runner.device)
    sync = (
        (lambda: torch.get_device_module(device).synchronize())
        if device.type != "cpu"
        else (lambda: None)
    )
    try:
        timings = time_sweep(run, shapes, repeats=repeats, sync=sync)
    finally:
        model_runner.decode_num_tokens_per_req = original
        if "decode_num_tokens_per_req" in vars(model_runner):
            del model_runner.decode_num_tokens_per_req
    return table_from_timings(timings)


def tokens_per_request_probes(verify_num_draft_tokens: int) -> list[int]:
    """1, 2, 4, ... and the full window gamma + 1."""
    ks = {verify_num_draft_tokens}
    k = 1
    while k < verify_num_draft_tokens:
        ks.add(k)
        k *= 2
    return sorted(ks)


def load_cached(key: SpsKey) -> SpsCostTable | None:
    path = cache_path(key)
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        return SpsCostTable.from_json(json.dumps(raw["table"]))
    except (ValueError, KeyError, TypeError) as e:
        logger.warning("ignoring unreadable SPS cache %s (%s); profiling again", path, e)
        return None


def save_cached(key: SpsKey, table: SpsCostTable, *, seconds: float) -> Path:
    """Write `<key>.json` ({"key", "table", "profile_seconds"}) and `<key>.table.json` (the bare
    SpsCostTable, what `--speculative-dspark-sps-table-path` takes), atomically."""
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    table_json = json.loads(table.to_json())
    record = {"key": asdict(key), "table": table_json, "profile_seconds": round(seconds, 3)}
    for target, payload in ((path, record), (bare_table_path(key), table_json)):
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_text(json.dumps(record if payload is record else payload, indent=1))
        tmp.replace(target)
    return path


def bare_table_path(key: SpsKey) -> Path:
    return sps_cache_dir() / f"{key.digest()}.table.json"


def table_at_startup(
    key: SpsKey, profile: Callable[[], SpsCostTable]
) -> tuple[SpsCostTable, bool, Path]:
    """The cached table for `key`, else profile and cache it. Returns (table, cached?, path)."""
    table = load_cached(key)
    if table is not None:
        return table, True, cache_path(key)
    t0 = time.perf_counter()
    table = profile()
    return table, False, save_cached(key, table, seconds=time.perf_counter() - t0)


def plot_table(table: SpsCostTable, out: str | Path, *, title: str = "SPS(B)") -> Path:
    """Steps/s and tokens/s upper bound (B * SPS) against batch tokens B, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys = table.sample_batch_tokens, table.sample_steps_per_sec
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.step(xs, ys, where="post", marker="o", label="steps/s (floor lookup)")
    ax.set_xlabel("verify batch tokens B")
    ax.set_ylabel("engine steps per second")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(
        xs,
        [x * y for x, y in zip(xs, ys)],
        color="tab:orange",
        marker=".",
        label="B x SPS (tokens/s if every token were accepted)",
    )
    ax2.set_ylabel("B x SPS")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="center left", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
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
    p.add_argument("--out", default=None, help="also copy the SpsCostTable JSON here")
    p.add_argument("--plot", default=None, help="write the SPS curve as a PNG here")
    p.add_argument("--force", action="store_true", help="drop a cached table first")
    p = sub.add_parser("plot", help="plot an SpsCostTable JSON (SGLang's format) as a PNG")
    p.add_argument("table")
    p.add_argument("--out", required=True)


def run(args) -> int:
    if args.sps_command == "plot":
        from sglang.srt.speculative.dspark_components.dspark_sps import load_sps_table_from_path

        table = load_sps_table_from_path(args.table)
        if not isinstance(table, SpsCostTable):
            raise ValueError(f"{args.table} is an additive cost table; only SpsCostTable plots")
        print(plot_table(table, args.out, title=f"SPS(B): {Path(args.table).name}"))
        return 0
    return _profile_with_embedded_server(args)


def _profile_with_embedded_server(args) -> int:
    import re
    import shutil
    import tempfile

    from sglang_dspark import embedded
    from sglang_dspark.server import SGLangServer, free_port

    paths = embedded.ensure(dtype=args.dtype)
    if args.force:
        for f in sps_cache_dir().glob("*.json"):
            f.unlink()
    port = free_port()
    log = Path(tempfile.gettempdir()) / f"sglang-dspark-sps-{port}.log"
    cmd = embedded.launch_command(paths, port=port, dtype=args.dtype)
    with SGLangServer(cmd, embedded.launch_env(scheduler="sync"), port, log) as server:
        text = server.log_text()
    found = re.findall(r"DSpark SPS table (?:profiled at start-up in [0-9.]+ s, cached at|"
                       r"read from) (\S+):", text)
    if not found:
        raise RuntimeError(f"the server did not report an SPS table; see {log}")
    record = json.loads(Path(found[-1]).read_text())
    table = SpsCostTable.from_json(json.dumps(record["table"]))
    print(f"SPS table {found[-1]} ({record.get('profile_seconds', '?')} s to profile)")
    print(f"{'B':>6} {'steps/s':>9} {'B x steps/s':>12}")
    for b, s in zip(table.sample_batch_tokens, table.sample_steps_per_sec):
        print(f"{b:>6} {s:>9.2f} {b * s:>12.1f}")
    if args.out:
        shutil.copy(Path(found[-1]).with_name(Path(found[-1]).stem + ".table.json"), args.out)
        print(f"wrote {args.out} (--speculative-dspark-sps-table-path)")
    if args.plot:
        print(f"wrote {plot_table(table, args.plot, title='SPS(B), embedded server')}")
    return 0
