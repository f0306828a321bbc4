"""Start, wait for and stop an SGLang server process (tests, benchmarks, data generation).

The server runs in its own process group so that stopping it also stops SGLang's scheduler
and detokenizer children. Output goes to a log file whose tail is shown if start-up fails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import requests


def _detach_and_die_with_parent() -> None:
    """In the child: own process group, and SIGTERM if the parent (test run, script) dies."""
    import ctypes

    os.setsid()
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message has its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class SGLangServer:
    cmd: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> SGLangServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # The child gets its own copy of the log's descriptor; the parent's is closed at once.
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                # prctl(PR_SET_PDEATHSIG) must run in the child; it only calls libc.
                preexec_fn=_detach_and_die_with_parent,  # noqa: PLW1509
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"SGLang exited with code {self.proc.returncode} during start-up:\n"
                    + self.log_tail()
                )
            try:
                if requests.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(2)
        self.stop()
        raise ServerStartError(
            f"SGLang did not become healthy in {timeout:.0f} s:\n" + self.log_tail()
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        # SGLang's children may outlive the parent for a moment; make sure none is left.
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def memory_pss_mb(self) -> float:
        """Proportional set size of the whole process group, in MB (shared pages split)."""
        if self.proc is None:
            return 0.0
        total_kb = 0
        for pid in group_pids(os.getpgid(self.proc.pid)):
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    total_kb += sum(int(x.split()[1]) for x in f if x.startswith("Pss:"))
            except (OSError, ProcessLookupError):
                continue
        return total_kb / 1024


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (a server and every process it started)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if os.getpgid(int(pid)) == pgid:
                out.append(int(pid))
        except (OSError, ProcessLookupError):
            continue
    return out
