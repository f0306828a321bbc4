"""Confidence-scheduled verification in a real SGLang 0.5.23 DSPARK server on CPU.

The embedded default runs SGLANG_DSPARK_SCHEDULER=sync: Algorithm 1 on the current
confidences, `compact` (ragged) verify, SPS profiled at start-up and cached on disk. The
greedy-equality and audit tests (test_serving.py, test_losslessness.py) run against that same
default server; here: that scheduling is really on, and STS data collection from the server.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import sglang
import torch
from conftest import eval_prompts

from sglang_dspark.calibration import load_data
from sglang_dspark.scheduling import sps
from sglang_dspark.serving.client import chat_prompt_ids, generate_many

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SPS_LINE = sps.STARTUP_LINE
CAP_LEN = re.compile(r"cap len: ([0-9.]+)")


@pytest.fixture(scope="module")
def prompt_ids(embedded_paths):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_paths.target)
    prompts = eval_prompts("gsm8k", 3) + eval_prompts("humaneval", 3) + eval_prompts("mt-bench", 2)
    return [chat_prompt_ids(tok, p) for p in prompts]


def _sps_cache_file(log: str) -> Path:
    found = SPS_LINE.findall(log)
    assert found, "the server neither profiled nor read an SPS table at start-up"
    return Path(found[-1])


def test_default_server_schedules_with_algorithm_1_and_a_start_up_sps_table(
    servers, embedded_paths, prompt_ids
):
    server = servers.get(embedded_paths)
    out = generate_many(server.base_url, prompt_ids, concurrency=8, max_new_tokens=24)
    assert all(len(o["output_ids"]) > 0 for o in out)
    log = server.log_text()
    assert "SGLANG_DSPARK_SCHEDULER=sync: overlap scheduling turned off" in log
    assert "ragged-verify scheduler enabled (mode=compact" in log
    record = json.loads(_sps_cache_file(log).read_text())
    assert record["key"]["sglang_version"] == sglang.__version__
    assert record["key"]["dtype"] == "bfloat16" and record["key"]["device"].startswith("cpu")
    table = record["table"]  # SGLang's additive table: bias + alpha(R) + theta(R + budget)
    theta, alpha = table["theta_seconds"], table["alpha_seconds"]
    assert len(table["m_probes"]) >= 8 and theta == sorted(theta) and theta[-1] > theta[0]
    assert table["bias_seconds"] > 0  # bigger verify batches take longer, from a fixed base
    assert alpha == sorted(alpha) and alpha[0] > 0  # the draft pass was timed, per request


@pytest.fixture(scope="module")
def traced(servers, embedded_paths, tmp_path_factory):
    """A scheduling server that records STS data and its verify trace. Collection records raw
    logits, so it runs without a calibration file."""
    draft = tmp_path_factory.mktemp("draft-uncalibrated")
    shutil.copytree(
        embedded_paths.draft, draft, dirs_exist_ok=True, ignore=shutil.ignore_patterns("sts.json")
    )
    out = tmp_path_factory.mktemp("traced")
    server = servers.get(
        embedded_paths, draft=draft, extra=("--decode-log-interval", "1"),
        env={"SGLANG_DSPARK_STS_COLLECT_PATH": str(out / "collect"),
             "SGLANG_DSPARK_VERIFY_TRACE": str(out / "trace")},
    )  # fmt: skip
    yield server, out
    servers.retire(server)  # no other test asks for it: room in the pool for test_serving's


def test_sts_data_collected_from_a_scheduling_server_keeps_the_verify_window(traced, prompt_ids):
    server, out_dir = traced
    stem = out_dir / "collect"
    out = generate_many(server.base_url, prompt_ids, concurrency=8, max_new_tokens=24)
    verify_steps = sum(o["meta_info"]["spec_verify_ct"] for o in out)
    # every finished request is on disk already: the server is still running
    data = load_data(str(stem) + ".rank0.*.pt")
    assert data.gamma == 7 and data.verified is not None
    assert data.num_samples >= verify_steps  # one row per request per verify step
    log = server.log_text()
    caps = [float(x) for x in CAP_LEN.findall(log)]
    assert caps and min(caps) < 8.0, "every step verified the whole block: no scheduling"
    assert (data.verified < 7).any(), "no verify window was trimmed"
    # labels stop at the window: accepted drafts never exceed the drafts verified
    n_accepted = (data.accepted & data.valid).sum(1)
    assert (n_accepted <= data.verified).all()
    assert not (data.valid & (torch.arange(7)[None, :] >= data.verified[:, None])).any()
    assert _sps_cache_file(log).is_file()


def test_server_verifies_algorithm_1s_lengths_on_its_own_confidences(traced, prompt_ids):
    """`sync` hands SGLang Algorithm 1's lengths: every traced step's layout (what the target
    really verified) equals schedule_sync on that step's confidences and the server's table."""
    from sglang.kernels.ops.speculative.dspark.dspark_schedule import schedule_verify_lens_topk
    from sglang.srt.speculative.dspark_components.dspark_planner import DSparkScheduleConfig

    from sglang_dspark.plugin.verify_trace import read_trace
    from sglang_dspark.scheduling.scheduler import schedule_sync

    server, out_dir = traced
    generate_many(server.base_url, prompt_ids, concurrency=8, max_new_tokens=32)
    table = sps.table_from_json(
        json.dumps(json.loads(_sps_cache_file(server.log_text()).read_text())["table"])
    )
    steps = [r for r in read_trace(str(out_dir / "trace") + ".rank0.jsonl") if r["confidence"]]
    assert len(steps) >= 20, f"only {len(steps)} traced verify steps"
    cfg = DSparkScheduleConfig(gamma=7)
    trimmed = topk_differs = 0
    for r in steps:
        c = torch.tensor(r["confidence"], dtype=torch.float64)[:, :7]
        want = (1 + schedule_sync(c, table)).clamp(1, 8).tolist()
        assert r["verify_lens"] == want, (r["step"], r["verify_lens"], want)
        assert r["budget"] == sum(want) - len(want)
        assert all(a <= v - 1 for a, v in zip(r["accepted"], r["verify_lens"]))
        trimmed += sum(v < 8 for v in want)
        upstream = schedule_verify_lens_topk(confidence=c.float(), budget=r["budget"], cfg=cfg)
        topk_differs += upstream.tolist() != want
    assert trimmed > 0, "no step trimmed any window: the test would not tell the modes apart"
    # concurrency reached the scheduler: steps with several requests were scheduled together
    assert max(r["bs"] for r in steps) >= 4
    print(f"{len(steps)} steps; upstream's top-K on the same budget differs in {topk_differs}")
