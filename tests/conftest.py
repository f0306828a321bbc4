"""Shared fixtures: the embedded target/draft, eval prompts, and a pool of SGLang servers.

A server start costs about a minute on 2 cores, so servers are started lazily, keyed by their
configuration, shared by every test in the session, and stopped at the end. At most five run
at once (each idle one sleeps, `--sleep-on-idle`, but holds 2-3 GB), the test files order
their tests so that few are started twice, and a configuration only one test uses is retired
after it (`ServerPool.retire`).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent / "controls"))
import dspark_test_controls as controls  # the test-only broken-sampler plugin


def eval_prompts(name: str, limit: int | None = None) -> list[str]:
    from sglang_dspark.evaluation.benchmarks import default_eval_dir, load_prompts

    return load_prompts(default_eval_dir(), name, limit)


@pytest.fixture(scope="session")
def embedded_paths():
    from sglang_dspark.serving import embedded

    return embedded.ensure()


@contextmanager
def broken_sampler(server, mode: str):
    """`server` (a speculative one started with the test-only controls plugin and
    SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE, its path in `server.break_switch`) with its sampler
    switched to the broken `mode` inside the block (the file is read at each verification),
    honest again after it: a negative control without a second start-up."""
    server.break_switch.write_text(mode)
    try:
        yield server
    finally:
        server.break_switch.write_text("")


def verify_every_draft(server) -> None:
    """`server` (DSPARK, a `compact` scheduler mode) verifies every draft from now on: upstream's
    runtime control `dspark_force_budget_frac` = 1 (the one its SPS profiler uses). For tests
    of the sampler, so that what they check does not hang on how this machine's start-up SPS
    profile trims a random draft's windows (on one CI machine it trimmed every window to none).
    It holds until the server stops: upstream's request schema takes numbers only and refuses
    the null that would hand the budget back to the scheduler (HTTP 400), so call it in the
    tests that run last on their server, or retire the server after it (`ServerPool.retire`)."""
    body = {"server_args": {"dspark_force_budget_frac": 1.0}}
    r = requests.post(server.base_url + "/set_internal_state", json=body, timeout=60)
    r.raise_for_status()
    # one answer per data-parallel rank: a bool, or a dict with `updated` (upstream's profiler
    # reads it the same way, `sglang.benchmark.dspark_sps_profiler.set_forced_budget_frac`)
    outs = r.json() if isinstance(r.json(), list) else [r.json()]
    ok = [o.get("updated") if isinstance(o, dict) else o for o in outs]
    assert ok and all(ok), f"forced budget refused: {r.json()}"


@dataclass
class Sampled:
    """Continuations per prompt, with the server's draft counts summed over them."""

    samples: list[list[list[int]]]
    correct: int  # drafts accepted
    proposed: int  # drafts proposed
    verified: int  # drafts inside the verified windows


def sample_prompts(server, prompts: list[list[int]], n: int, sampling_params: dict) -> Sampled:
    """`n` continuations of each prompt (token ids), one /generate request per prompt."""
    out = Sampled([], 0, 0, 0)
    for ids in prompts:
        body = {"input_ids": [ids] * n, "sampling_params": sampling_params}
        r = requests.post(server.base_url + "/generate", json=body, timeout=3600)
        r.raise_for_status()
        rows = r.json()
        out.samples.append([row["output_ids"] for row in rows])
        for m in (row["meta_info"] for row in rows):
            out.correct += m.get("spec_num_correct_drafts", 0)
            out.proposed += m.get("spec_num_proposed_drafts", 0)
            # SGLang's cap length counts a window's tokens: the drafts and the one position
            # after them (`verify_lens`)
            verify_ct = m.get("spec_verify_ct", 0)
            out.verified += round(m.get("spec_cap_length", 0) * verify_ct) - verify_ct
    return out


class ServerPool:
    """Lazily started SGLang servers, keyed by (dtype, speculative, extra args, env)."""

    def __init__(self, log_dir: Path, max_live: int = 5):
        self.log_dir = log_dir
        self.max_live = max_live
        self.live: OrderedDict[tuple, object] = OrderedDict()

    def get(
        self, paths, *, dtype="bfloat16", speculative=True, extra=(), env=None, draft=None,
        arm="dspark",
    ):  # fmt: skip
        from dataclasses import replace

        from sglang_dspark.plugin import cpu_gemm, plain_rounds
        from sglang_dspark.serving import embedded
        from sglang_dspark.serving.server import SGLangServer, free_port

        env = dict(env or {})
        key = (dtype, speculative, arm, tuple(extra), tuple(sorted(env.items())), str(draft))
        if key in self.live:
            self.live.move_to_end(key)
            return self.live[key]
        while len(self.live) >= self.max_live:
            _, old = self.live.popitem(last=False)
            old.stop()
        if draft is not None:
            field = "mtp1_draft" if arm == "mtp1" else "draft"
            paths = replace(paths, **{field: Path(draft)})
        port = free_port()
        switch = self.log_dir / f"break-sampler-{port}"
        launch_env = {**embedded.launch_env(), **env}
        # Every DSPARK round drafts unless a test asks otherwise: the tests that compare rounds,
        # traces or accepted drafts need them all drafted; the plain-round policy
        # (`cpu_plain_rounds`, on by default in a server) has its own tests.
        launch_env.setdefault(plain_rounds.MODE_ENV, "off")
        # Every half-precision linear in float32 (`cpu_half_gemm_fp32` with one row minimum):
        # a batch-invariant engine, so that token-for-token comparisons between arms, batch
        # sizes and verify windows compare the algorithm, not which GEMM a row's batch took.
        # The default threshold has its own server tests (the README's serve command).
        launch_env.setdefault(cpu_gemm.MIN_ROWS_ENV, "1")
        if speculative:  # the broken-sampler switch: a test-only plugin on the server's path
            launch_env = controls.server_env(launch_env)
            if controls.MODE_ENV not in env:
                launch_env[controls.FILE_ENV] = str(switch)
        server = SGLangServer(
            cmd=embedded.launch_command(
                paths, port=port, dtype=dtype, speculative=speculative, arm=arm, extra=list(extra)
            ),
            env=launch_env,
            port=port,
            log_path=self.log_dir / f"server-{port}.log",
        )
        server.start()
        server.break_switch = switch
        self.live[key] = server
        return server

    broken = staticmethod(broken_sampler)

    def retire(self, server) -> None:
        """Stop `server` and forget it: the next `get` with its key starts a fresh one. After a
        test changed it for good (`verify_every_draft`), or after the last test that asks for
        its configuration: the room goes to shared servers that LRU eviction would otherwise
        stop and a later file start again (about a minute each)."""
        for key, live in list(self.live.items()):
            if live is server:
                del self.live[key]
        server.stop()

    def stop_all(self):
        for server in self.live.values():
            server.stop()
        self.live.clear()


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("server-logs"))
    yield pool
    pool.stop_all()


def pytest_runtest_logreport(report):
    """With DSPARK_TEST_TIMINGS=FILE, each test phase's duration is appended to FILE as it
    ends: the suite's time per test can be read while it runs (or after it was killed)."""
    import os

    path = os.environ.get("DSPARK_TEST_TIMINGS")
    if path:
        with open(path, "a") as f:
            f.write(
                f"{report.duration:9.1f} {report.when:8s} {report.outcome:7s} {report.nodeid}\n"
            )


@pytest.fixture
def v4_switch(monkeypatch):
    """Set SGLANG_DSPARK_V4_KERNELS for this test (None: unset); the process's cached choice is
    re-read around it."""
    from sglang_dspark.plugin import v4_kernels

    def set_to(value: str | None):
        if value is None:
            monkeypatch.delenv(v4_kernels.ENV, raising=False)
        else:
            monkeypatch.setenv(v4_kernels.ENV, value)
        v4_kernels.v4_kernels.cache_clear()

    yield set_to
    v4_kernels.v4_kernels.cache_clear()
