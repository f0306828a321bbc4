"""Shared fixtures: the embedded target/draft, eval prompts, and a pool of SGLang servers.

A server start costs about a minute on 2 cores, so servers are started lazily, keyed by their
configuration, shared by every test in the session, and stopped at the end. At most three run
at once (each idle one sleeps: `--sleep-on-idle`).
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path

import pytest


def eval_prompts(name: str, limit: int | None = None) -> list[str]:
    from sglang_dspark.evaluation.benchmarks import default_eval_dir, load_prompts

    return load_prompts(default_eval_dir(), name, limit)


@pytest.fixture(scope="session")
def embedded_paths():
    from sglang_dspark import embedded

    return embedded.ensure()


class ServerPool:
    """Lazily started SGLang servers, keyed by (dtype, speculative, extra args, env)."""

    def __init__(self, log_dir: Path, max_live: int = 3):
        self.log_dir = log_dir
        self.max_live = max_live
        self.live: OrderedDict[tuple, object] = OrderedDict()

    def get(
        self, paths, *, dtype="bfloat16", speculative=True, extra=(), env=None, draft=None,
        arm="dspark",
    ):  # fmt: skip
        from dataclasses import replace

        from sglang_dspark import embedded
        from sglang_dspark.server import SGLangServer, free_port

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
        if speculative and "SGLANG_DSPARK_TEST_BREAK_SAMPLER" not in env:
            env["SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE"] = str(switch)
        server = SGLangServer(
            cmd=embedded.launch_command(
                paths, port=port, dtype=dtype, speculative=speculative, arm=arm, extra=list(extra)
            ),
            env={**embedded.launch_env(), **env},
            port=port,
            log_path=self.log_dir / f"server-{port}.log",
        )
        server.start()
        server.break_switch = switch
        self.live[key] = server
        return server

    @staticmethod
    @contextmanager
    def broken(server, mode: str):
        """`server` (a speculative one from `get`) with its sampler switched to the test-only
        broken `mode` inside the block (SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE, read at each
        verification), honest again after it: a negative control without a second start-up."""
        server.break_switch.write_text(mode)
        try:
            yield server
        finally:
            server.break_switch.write_text("")

    def stop_all(self):
        for server in self.live.values():
            server.stop()
        self.live.clear()


@pytest.fixture(scope="session")
def servers(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("server-logs"))
    yield pool
    pool.stop_all()
