"""SLA load test: streaming chat completions swept over concurrency levels.

Each stage holds a fixed number of concurrent users for SLA_STAGE_SECONDS; every user sends
OpenAI-compatible streaming chat completions back to back. Per request we record the time to
first token (TTFT) and the user's decode speed (output tokens after the first / time after the
first token). At the end a summary per concurrency level is written as JSON and CSV and printed,
and the run stops by itself after the last stage.

    SLA_USERS=1,4,16 SLA_STAGE_SECONDS=60 \
      locust -f loadtest/sla.py --headless --host http://127.0.0.1:30000

Environment:
    SLA_USERS           comma-separated concurrency levels, one stage each (default "1,4,16")
    SLA_STAGE_SECONDS   seconds per stage (default 60)
    SLA_MAX_TOKENS      max_tokens per request (default 256)
    SLA_TEMPERATURE     sampling temperature (default 0.0)
    SLA_MODEL           model name; empty: the first id from GET /v1/models
    SLA_PROMPTS_FILE    optional JSON lines file of {"turns": ["..."]}; the first turn is the prompt
    SLA_EXTRA_BODY      optional JSON object merged into every request, e.g.
                        '{"chat_template_kwargs": {"enable_thinking": false}}'
    SLA_OUTPUT_DIR      where sla_summary.json / sla_summary.csv go (default ".")

Run it as one locust process (no --processes / workers): samples are kept in memory per process.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from locust import HttpUser, LoadTestShape, events, task

log = logging.getLogger("sla")

DEFAULT_PROMPTS = (
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "A train travels 180 km in 2.5 hours. What is its average speed in km/h? Show your steps.",
    "List five practical tips for writing readable code.",
    "Summarize the difference between a process and a thread.",
    "Translate 'Good morning, how are you?' into French and Spanish.",
)


@dataclass(frozen=True)
class SlaConfig:
    users: tuple[int, ...]
    stage_seconds: float
    max_tokens: int
    temperature: float
    model: str
    prompts: tuple[str, ...]
    output_dir: Path
    extra_body: dict

    @classmethod
    def from_env(cls) -> SlaConfig:
        users = tuple(int(u) for u in os.environ.get("SLA_USERS", "1,4,16").split(",") if u.strip())
        if not users or min(users) < 1:
            raise ValueError(f"SLA_USERS must list positive integers like '1,4,16', got {users!r}")
        stage_seconds = float(os.environ.get("SLA_STAGE_SECONDS", "60"))
        if stage_seconds <= 0:
            raise ValueError(f"SLA_STAGE_SECONDS must be > 0, got {stage_seconds}")
        prompts = DEFAULT_PROMPTS
        if prompts_file := os.environ.get("SLA_PROMPTS_FILE"):
            with open(prompts_file, encoding="utf-8") as fh:
                prompts = tuple(json.loads(line)["turns"][0] for line in fh if line.strip())
            if not prompts:
                raise ValueError(f"SLA_PROMPTS_FILE {prompts_file} holds no prompts")
        return cls(
            users=users,
            stage_seconds=stage_seconds,
            max_tokens=int(os.environ.get("SLA_MAX_TOKENS", "256")),
            temperature=float(os.environ.get("SLA_TEMPERATURE", "0.0")),
            model=os.environ.get("SLA_MODEL", ""),
            prompts=prompts,
            output_dir=Path(os.environ.get("SLA_OUTPUT_DIR", ".")),
            extra_body=json.loads(os.environ.get("SLA_EXTRA_BODY") or "{}"),
        )


@dataclass
class Sample:
    stage: int
    ok: bool
    ttft_s: float = 0.0
    output_tokens: int = 0
    decode_tok_per_s: float = 0.0  # per-user speed after the first token
    e2e_s: float = 0.0


@dataclass
class SlaRecorder:
    config: SlaConfig
    started_at: float = 0.0
    samples: list[Sample] = field(default_factory=list)

    def stage_now(self) -> int:
        return int((time.monotonic() - self.started_at) // self.config.stage_seconds)

    def summary(self) -> list[dict]:
        rows = []
        for stage, users in enumerate(self.config.users):
            done = [s for s in self.samples if s.stage == stage]
            ok = [s for s in done if s.ok]
            speeds = [s.decode_tok_per_s for s in ok if s.decode_tok_per_s > 0]
            ttfts = [s.ttft_s for s in ok]
            rows.append(
                {
                    "users": users,
                    "requests": len(done),
                    "failures": len(done) - len(ok),
                    "ttft_p50_s": _quantile(ttfts, 0.50),
                    "ttft_p90_s": _quantile(ttfts, 0.90),
                    "ttft_p99_s": _quantile(ttfts, 0.99),
                    "user_tok_s_mean": statistics.fmean(speeds) if speeds else 0.0,
                    "user_tok_s_p10": _quantile(speeds, 0.10),
                    "user_tok_s_p50": _quantile(speeds, 0.50),
                    "output_tok_s_total": sum(s.output_tokens for s in ok)
                    / self.config.stage_seconds,
                }
            )
        return rows

    def write(self) -> list[dict]:
        rows = self.summary()
        self.config.output_dir.mkdir(parents=True, exist_ok=True)
        report = {
            "config": {**asdict(self.config), "output_dir": str(self.config.output_dir)},
            "stages": rows,
        }
        report["config"].pop("prompts")
        (self.config.output_dir / "sla_summary.json").write_text(json.dumps(report, indent=2))
        with open(
            self.config.output_dir / "sla_summary.csv", "w", newline="", encoding="utf-8"
        ) as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        return rows


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    environment.sla = SlaRecorder(SlaConfig.from_env())


@events.test_start.add_listener
def _on_test_start(environment, **_kwargs) -> None:
    environment.sla.started_at = time.monotonic()


@events.test_stop.add_listener
def _on_test_stop(environment, **_kwargs) -> None:
    rows = environment.sla.write()
    header = f"{'users':>6} {'reqs':>6} {'fail':>5} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s/user p50':>15} {'tok/s total':>12}"
    lines = [header] + [
        f"{r['users']:>6} {r['requests']:>6} {r['failures']:>5} {r['ttft_p50_s']:>9.3f} "
        f"{r['ttft_p90_s']:>9.3f} {r['user_tok_s_p50']:>15.1f} {r['output_tok_s_total']:>12.1f}"
        for r in rows
    ]
    print(
        f"SLA summary (written to {environment.sla.config.output_dir}):\n" + "\n".join(lines),
        flush=True,
    )


class ChatUser(HttpUser):
    """One client: streaming chat completions, one after another, no think time."""

    def on_start(self) -> None:
        self.sla: SlaRecorder = self.environment.sla
        self.prompts = itertools.cycle(self.sla.config.prompts)
        self.model = self.sla.config.model or self._first_model()

    def _first_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as resp:
            if resp.status_code != 200:
                resp.failure(f"GET /v1/models returned {resp.status_code}")
                return "default"
            return resp.json()["data"][0]["id"]

    @task
    def chat(self) -> None:
        cfg = self.sla.config
        stage = self.sla.stage_now()
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": next(self.prompts)}],
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            **cfg.extra_body,
        }
        start = time.perf_counter()
        first = 0.0
        chunks = 0
        usage_tokens = None
        with self.client.post(
            "/v1/chat/completions",
            json=payload,
            stream=True,
            catch_response=True,
            name="chat (stream)",
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                self.sla.samples.append(Sample(stage=stage, ok=False))
                return
            buffer = b""
            for piece in resp.iter_content(chunk_size=None):
                buffer += piece
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    event = json.loads(line[5:])
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                    for choice in event.get("choices", []):
                        if choice.get("delta", {}).get("content"):
                            chunks += 1
                            if not first:
                                first = time.perf_counter()
            end = time.perf_counter()
            resp.request_meta["response_time"] = (end - start) * 1000.0  # whole stream, not headers
            if not first:
                resp.failure("stream ended without any content")
                self.sla.samples.append(Sample(stage=stage, ok=False))
                return
            tokens = usage_tokens or chunks
            decode_time = end - first
            self.sla.samples.append(
                Sample(
                    stage=stage,
                    ok=True,
                    ttft_s=first - start,
                    output_tokens=tokens,
                    decode_tok_per_s=(tokens - 1) / decode_time
                    if tokens > 1 and decode_time > 0
                    else 0.0,
                    e2e_s=end - start,
                )
            )
            resp.success()


class ConcurrencySweep(LoadTestShape):
    """One stage per SLA_USERS entry, SLA_STAGE_SECONDS each; returning None ends the run."""

    def tick(self) -> tuple[int, float] | None:
        cfg: SlaConfig = self.runner.environment.sla.config
        stage = int(self.get_run_time() // cfg.stage_seconds)
        if stage >= len(cfg.users):
            return None
        users = cfg.users[stage]
        return users, float(users)  # spawn the whole stage at once
