"""SLA load test: streaming chat completions swept over concurrency levels (Locust).

    SLA_USERS=1,4,16 SLA_STAGE_SECONDS=60 SLA_LABEL=dspark-sync \
      locust -f loadtest/sla.py --headless --host http://127.0.0.1:30000

Each stage holds SLA_USERS[i] concurrent users for SLA_STAGE_SECONDS; every user sends
OpenAI-compatible streaming chat completions back to back (closed loop, no think time). Then
the stage drains: users send nothing new, the requests in flight finish, and only then does the
next stage start, so no request of one level runs under the next level's load. Each stage is
measured over its steady-state window [start + SLA_WARMUP_SECONDS, start + SLA_STAGE_SECONDS):
aggregate output tok/s counts the tokens generated inside the window (requests clipped to it by
their token timeline), latency distributions use the requests started inside it. Token counts
always come from the server's usage (`stream_options.include_usage`, per chunk with
`continuous_usage_stats`), never from counting chunks. The metric definitions are in
`sglang_dspark/measurement/loadmetrics.py`, which holds all the maths (pure, tested); this file is the
Locust glue.

At the start of the run and of each stage, and at each stage's end, GET /server_info records
what was measured (speculative algorithm, draft model, block size, num_draft_tokens,
avg_spec_accept_length); each request also asks for SGLang's per-request speculative details
(accept length, verify length = `spec_cap_length`) for the verify-budget plot.

Outputs in SLA_OUTPUT_DIR: sla_summary.json (config, server info, per-stage rows, per-request
samples) and sla_summary.csv (one row per stage), and a table on stdout. Plot arms against each
other with `sglang-dspark pareto RUN_DIR... --out DIR` (or `python -m sglang_dspark.measurement.pareto`).

The exit code is 1 when a request failed, a response had no usage (tokens unknown), an SLO was
breached, a drain timed out, or the server could not be reached; the reasons are printed.

Environment:
    SLA_USERS             comma-separated concurrency levels, one stage each (default "1,4,16")
    SLA_STAGE_SECONDS     seconds each level is held before its drain (default 60)
    SLA_WARMUP_SECONDS    start of each stage left out of its window (default 10% of the
                          stage, at least 2 s, at most a quarter of it)
    SLA_DRAIN_TIMEOUT_S   longest wait for a stage's in-flight requests (default 600)
    SLA_REQUEST_TIMEOUT_S HTTP timeout per request: connect and between bytes (default 600)
    SLA_MAX_TOKENS        max_tokens per request (default 256)
    SLA_IGNORE_EOS        1: add "ignore_eos": true, every request generates SLA_MAX_TOKENS
                          (default 0)
    SLA_TEMPERATURE       sampling temperature (default 0.0)
    SLA_MODEL             model name; empty: the first id from GET /v1/models
    SLA_PROMPTS_FILE      prompts: JSON lines of {"turns": ["..."]} (the first turn) or a
                          ShareGPT JSON list of {"conversations": [{"from": "human", "value":
                          "..."}, ...]} (the first human turn), detected from the content.
                          Default: the packaged eval prompts (gsm8k, humaneval, mt-bench,
                          interleaved) from $DSPARK_EVAL_DIR or sglang_dspark/assets/eval, else
                          six built-in prompts. Users take prompts in turn from one shared cycle.
    SLA_INPUT_TOKENS      optional prompt length, approximated in whitespace-separated words:
                          longer prompts are cut, shorter ones repeated, to that many words
    SLA_EXTRA_BODY        JSON object merged into every request, e.g.
                          '{"chat_template_kwargs": {"enable_thinking": false}}'
    SLA_SPEC_DETAILS      1 (default): ask for SGLang's per-request speculative details
                          ("return_spec_tokens_details"); 0 for servers that reject the field
    SLA_SLO_TTFT_S        SLO on time to first token, seconds (default: none)
    SLA_SLO_TPOT_S        SLO on time per output token after the first, seconds (default: none)
    SLA_SLO_ATTAINMENT    fraction of a stage's requests that must meet the SLOs (default 0.9)
    SLA_LABEL             the arm's name in the summary and the plots (default from
                          /server_info, e.g. "dspark-k8" or "no-spec"); SGLANG_DSPARK_SCHEDULER
                          is not visible to the client, so name it here, e.g. "dspark-async"
    SLA_OUTPUT_DIR        where sla_summary.json / sla_summary.csv go (default ".")

Run it as one Locust process (no --processes / --master / --worker): samples are kept in memory.
The client's own CPU share per stage is reported (cpu%): near 100% the client, not the server,
limits the numbers. HttpUser with iter_content(chunk_size=None) reads the stream as it arrives
(FastHttpUser buffers it and inflates TTFT).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from pathlib import Path

import gevent
import requests
from gevent import GreenletExit
from locust import HttpUser, LoadTestShape, constant, events, task
from locust.runners import MasterRunner, WorkerRunner

HERE = Path(__file__).resolve()
REPO = HERE.parents[1] if len(HERE.parents) > 1 else HERE.parent
if (HERE.parent / "loadmetrics.py").is_file():  # shipped side by side (the Helm chart's Job)
    sys.path.insert(0, str(HERE.parent))
    import loadmetrics as lm
else:
    try:
        from sglang_dspark.measurement import loadmetrics as lm
    except ImportError:  # a checkout without `pip install -e .`
        sys.path.insert(0, str(REPO))
        try:
            from sglang_dspark.measurement import loadmetrics as lm
        except ImportError:
            sys.exit(
                f"{HERE.name} needs sglang_dspark/measurement/loadmetrics.py: install sglang-dspark "
                f"(pip install -e .) or put loadmetrics.py next to {HERE}"
            )

log = logging.getLogger("sla")
POLL_S = 0.05  # how often an idle user (drain, full stage) looks again


def eval_dirs() -> list[Path]:
    dirs = [Path(os.environ["DSPARK_EVAL_DIR"])] if os.environ.get("DSPARK_EVAL_DIR") else []
    return dirs + [
        REPO / "sglang_dspark" / "assets" / "eval",
        Path(lm.__file__).resolve().parent / "assets" / "eval",
    ]


class SlaRun:
    """The run's state: configuration, stage clock, samples, server snapshots."""

    def __init__(self, config: lm.SlaConfig):
        self.config = config
        self.clock = lm.SweepClock(
            config.users,
            config.stage_seconds,
            config.warmup_seconds,
            config.drain_timeout_seconds,
        )
        self.prompts = itertools.cycle(config.prompts)
        self.samples: list[lm.Sample] = []
        self.t0: float | None = None
        self.host = ""
        self.model = config.model
        self.server_info: dict | None = None
        self.stage_server_info: dict[int, dict] = {}
        self.cpu: dict[int, list[float]] = {}  # stage -> [wall0, cpu0, wall1, cpu1]
        self.problems: list[str] = []
        self.finished = False

    def now(self) -> float:
        return time.perf_counter() - (self.t0 or 0.0)

    # --- server -------------------------------------------------------------------------

    def _get(self, path: str, timeout: float = 30.0) -> dict:
        resp = requests.get(self.host.rstrip("/") + path, timeout=timeout)
        resp.raise_for_status()
        return resp.json()

    def preflight(self, host: str | None) -> bool:
        if not host:
            self.problems.append(
                "no --host given: pass the server URL, e.g. --host http://127.0.0.1:30000"
            )
            return False
        self.host = host
        url = host.rstrip("/") + "/v1/models"
        try:
            models = self._get("/v1/models")
            if not self.model:
                self.model = models["data"][0]["id"]
        except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
            self.problems.append(f"could not reach {url}: {exc}; is the server running?")
            return False
        try:
            self.server_info = self._get("/server_info")
        except (requests.RequestException, ValueError) as exc:
            log.warning(
                "GET %s/server_info failed (%s): the summary will not say which "
                "server was measured",
                host,
                exc,
            )
        label = lm.arm_label(self.config.label, self.server_info)
        fields = lm.server_fields(self.server_info)
        print(
            f"SLA run '{label}' against {host}, model {self.model}: "
            f"speculative_algorithm={fields['speculative_algorithm']}, "
            f"num_draft_tokens={fields['speculative_num_draft_tokens']}; "
            f"{len(self.config.prompts)} prompts from {self.config.prompts_source}",
            flush=True,
        )
        return True

    def _snapshot(self, stage: int, when: str) -> None:
        try:
            info = lm.trim_server_info(self._get("/server_info", timeout=10.0))
            self.stage_server_info.setdefault(stage, {})[when] = {
                "t": self.now(),
                "internal_states": info.get("internal_states"),
            }
        except (requests.RequestException, ValueError, AttributeError) as exc:
            log.debug("/server_info at stage %d %s: %s", stage, when, exc)

    # --- the shape ----------------------------------------------------------------------

    def tick(self, host: str | None) -> int | None:
        if self.t0 is None:
            if not self.preflight(host):
                return None
            self.t0 = time.perf_counter()
        users, stage_events = self.clock.tick(self.now())
        if stage_events and stage_events[0][0] == "end":
            stage = stage_events[0][1]
            self.cpu[stage] += [time.perf_counter(), time.process_time()]
            self._snapshot(stage, "end")  # the server is idle now: before the next stage
            if users is not None:
                users, stage_events = self.clock.tick(self.now())
        if stage_events and stage_events[0][0] == "start":
            stage = stage_events[0][1]
            self.cpu[stage] = [time.perf_counter(), time.process_time()]
            gevent.spawn(self._snapshot, stage, "start")  # not delaying the users
            log.info(
                "stage %d: %d users for %.0f s",
                stage,
                self.clock.users[stage],
                self.config.stage_seconds,
            )
        return users

    # --- the end ------------------------------------------------------------------------

    def finish(self) -> list[str]:
        """Summarise, write, print; the problems (empty: exit code 0)."""
        if self.finished:
            return self.problems
        self.finished = True
        if self.t0 is None:  # never started
            for p in self.problems:
                print(f"SLA run failed: {p}", file=sys.stderr, flush=True)
            return self.problems
        self.clock.stop(self.now())
        rows = []
        for w in self.clock.stages:
            row = lm.summarize_stage(self.samples, w, self.config.slo)
            ends = self.stage_server_info.get(w.index, {}).get("end")
            if ends:
                row.server_accept_len = lm.server_accept_length(ends)
            marks = self.cpu.get(w.index, [])
            if len(marks) == 4 and marks[2] > marks[0]:
                row.client_cpu_share = (marks[3] - marks[1]) / (marks[2] - marks[0])
            rows.append(row)
        if len(rows) < len(self.config.users):
            self.problems.append(
                f"the run stopped early: {len(rows)} of {len(self.config.users)} stages ran"
            )
        self.problems += lm.run_problems(rows, self.config.slo)
        report = lm.build_report(
            self.config,
            self.host,
            self.model,
            self.server_info,
            rows,
            self.clock.stages,
            self.stage_server_info,
            self.samples,
            self.problems,
        )
        js, _ = lm.write_report(report, self.config.output_dir)
        print(
            f"SLA summary '{report['label']}' (written to {js.parent}; times in s):\n"
            + lm.format_table(report["stages"]),
            flush=True,
        )
        busiest = max((r.client_cpu_share or 0.0 for r in rows), default=0.0)
        if busiest > 0.7:
            print(
                f"warning: the load-test client used {busiest:.0%} of a CPU core in a stage: "
                "it may be the bottleneck; run it on a less busy machine",
                flush=True,
            )
        for p in self.problems:
            print(f"SLA problem: {p}", file=sys.stderr, flush=True)
        return self.problems


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    if isinstance(environment.runner, MasterRunner | WorkerRunner):
        sys.exit(
            f"{HERE.name} keeps its samples in memory: run it as one process "
            "(no --processes / --master / --worker)"
        )
    try:
        environment.sla = SlaRun(lm.SlaConfig.from_env(eval_dirs=eval_dirs()))
    except (ValueError, TypeError) as exc:
        sys.exit(f"{HERE.name}: {exc}")


@events.test_stop.add_listener
def _on_test_stop(environment, **_kwargs) -> None:
    if environment.sla.finish():
        environment.process_exit_code = 1


class ChatUser(HttpUser):
    """One client: streaming chat completions, one after another, no think time."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.sla: SlaRun = self.environment.sla

    @task
    def chat(self) -> None:
        stage = self.sla.clock.acquire(self.sla.now())
        if stage is None:  # draining, between stages, or the stage has its users busy
            time.sleep(POLL_S)
            return
        try:
            self.sla.samples.append(self._request(stage))
        finally:
            self.sla.clock.release(stage, self.sla.now())

    def _request(self, stage: int) -> lm.Sample:
        sla = self.sla
        body = sla.config.request_body(sla.model, next(sla.prompts))
        parser = lm.StreamParser(stage, sla.now())
        try:
            with self.client.post(
                "/v1/chat/completions",
                json=body,
                stream=True,
                catch_response=True,
                name="chat (stream)",
                timeout=sla.config.request_timeout_seconds,
            ) as resp:
                if resp.status_code != 200:
                    detail = resp.error if resp.status_code == 0 else (resp.text or "")[:300]
                    error = f"HTTP {resp.status_code}: {detail}"
                    resp.failure(error)
                    return parser.finish(sla.now(), error=error)
                try:
                    for piece in resp.iter_content(chunk_size=None):
                        parser.feed(piece, sla.now())
                    sample = parser.finish(sla.now())
                except requests.RequestException as exc:
                    sample = parser.finish(sla.now(), error=f"{type(exc).__name__}: {exc}")
                resp.request_meta["response_time"] = sample.e2e * 1000.0  # whole stream
                if not sample.ok:
                    resp.failure(sample.error)
                elif not sample.tokens_known:
                    resp.failure("no usage.completion_tokens in the stream: tokens unknown")
                else:
                    resp.success()
                return sample
        except GreenletExit:
            sla.samples.append(parser.finish(sla.now(), error="stopped by locust mid-request"))
            raise


class ConcurrencySweep(LoadTestShape):
    """One stage per SLA_USERS entry: hold, then drain; returning None ends the run."""

    def tick(self) -> tuple[int, float] | None:
        env = self.runner.environment
        users = env.sla.tick(env.host)
        if users is None:
            return None
        return users, float(4 * users)  # the whole stage within ~0.25 s
