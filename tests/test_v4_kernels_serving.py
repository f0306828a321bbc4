"""The tiny DeepSeek-V4 with DSPARK on CPU, served once with `dspark_kernels`' references and once
with its Triton kernels (`SGLANG_DSPARK_V4_KERNELS=triton`, under Triton's interpreter).

Same checkpoint (its bundled draft), flags, seed and prompts (5, 45 and 200 tokens: the
sliding window, C4 groups and the indexer, one C128 group), one request at a time, greedy. The
start-up SPS profile is off on both servers (`SGLANG_DSPARK_SPS_PROFILE=0`), so the scheduler
prices verification by the same flat table and its choices depend on the model's numbers only,
and every round drafts (`SGLANG_DSPARK_PLAIN_ROUNDS=off`): the plain-round policy chooses by
measured wall-clock rates, so with it on a round drafts or not depending on the machine's load,
and a plain round reports confidences of exactly 0.
Every C4 row here is taken whole by the indexer's top-k (about 55 compressed positions at most, of
its 512); the selection itself is checked against SGLang's on SGLang's logits in
`tests/test_v4_index_topk_switch.py`, and served (reference route) by the 2300-token prompt of
`tests/test_v4_cpu_serving.py`.
Required: identical output tokens and identical DSPARK verification (the verify lengths and
accepted drafts of every step, from `SGLANG_DSPARK_VERIFY_TRACE`, and each request's accepted
draft count), and the draft's confidences of every step within `CONFIDENCE_ABS`.

The numbers are not bit-identical: the Triton compressor sums its float32 softmax pooling in
another order than torch does, and those rows go through the bf16 and fp8 roundings of the
store (the other routed calls write the same bytes as the references on the unit tests,
`tests/test_v4_kernel_switch.py`). Measured (2026-12, 34 steps): confidences differ by at most
1.2e-3 (95 of 170 values differ at all), tokens and verification identical, and two triton runs
give the same confidences bit for bit. (An earlier version of this test left the plain-round
policy at its default, `auto`: one triton run then decoded 21 of its 34 rounds plainly, with
confidences 0.0, which looked like a non-deterministic kernel.) The checkpoint's
draft is random, so it is almost never accepted (0 drafts in those 34 steps): the acceptance
comparison is weak here; the confidences carry the draft's side of the comparison.
"""

from __future__ import annotations

import os
import sys

import pytest
import requests
import torch

from sglang_dspark.plugin import plain_rounds, v4_kernels
from sglang_dspark.plugin.verify_trace import read_trace, trace_path
from sglang_dspark.serving.server import SGLangServer, free_port

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

NEW_TOKENS = 10
PROMPT_LENS = (5, 45, 200)
SEED = 0
CONFIDENCE_ABS = 0.01


@pytest.fixture(scope="module")
def tiny_v4(servers):
    """The tiny V4 checkpoint; the session's SmolLM2 servers are stopped first (memory)."""
    from sglang_dspark.v4 import tiny

    servers.stop_all()
    return tiny.build_tiny_v4()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(SEED)
    return [torch.randint(100, 49000, (n,), generator=g).tolist() for n in PROMPT_LENS]


def serve(tiny_v4, log_dir, kernels: str, prompts) -> dict:
    """Start the DSPARK server with the switch at `kernels`, generate each prompt greedily one
    at a time, stop it: responses, verify trace and server log."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(tiny_v4),
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(port), "--random-seed", str(SEED),
        "--disable-cuda-graph", "--max-total-tokens", "8192", "--swa-full-tokens-ratio", "0.5",
        "--max-running-requests", "4", "--sleep-on-idle", "--speculative-algorithm", "DSPARK",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SGLANG_") and k != "TRITON_INTERPRET"}  # fmt: skip
    stem = log_dir / "trace"
    env.update({v4_kernels.ENV: kernels, "SGLANG_DSPARK_SPS_PROFILE": "0",
                plain_rounds.MODE_ENV: "off",  # every round drafts: no wall-clock choice
                "SGLANG_DSPARK_VERIFY_TRACE": str(stem)})  # fmt: skip
    srv = SGLangServer(cmd, env, port, log_dir / "server.log")
    srv.start(timeout=1200)
    try:
        responses = []
        for ids in prompts:
            body = {"input_ids": ids,
                    "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}  # fmt: skip
            r = requests.post(srv.base_url + "/generate", json=body, timeout=1800)
            r.raise_for_status()
            responses.append(r.json())
    finally:
        srv.stop()
    return {"responses": responses, "trace": read_trace(trace_path(str(stem), 0)),
            "log": srv.log_text()}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_v4, prompts, tmp_path_factory) -> dict[str, dict]:
    return {
        kernels: serve(tiny_v4, tmp_path_factory.mktemp(f"v4-{kernels}"), kernels, prompts)
        for kernels in ("reference", "triton")
    }


def test_each_server_ran_the_chosen_kernels(runs):
    """The scheduler logged its choice; the triton launch put Triton in its interpreter; the
    C4 indexer's top-k went through `v4_cpu_index_topk` (logged at its first call)."""
    ref_log, triton_log = runs["reference"]["log"], runs["triton"]["log"]
    assert "DeepSeek-V4 CPU kernels: dspark_kernels' torch references" in ref_log
    assert "DeepSeek-V4 CPU kernels: dspark_kernels' Triton kernels" in triton_log
    assert "TRITON_INTERPRET=1 set for this launch" in triton_log
    assert "C4 indexer top-512 by dspark_kernels' topk_transform_reference" in ref_log
    assert "C4 indexer top-512 by dspark_kernels' topk_transform (Triton)" in triton_log


def test_triton_kernels_serve_the_same_tokens_and_acceptances(runs):
    ref, tri = runs["reference"], runs["triton"]
    for a, b in zip(ref["responses"], tri["responses"], strict=True):
        assert len(a["output_ids"]) == NEW_TOKENS
        assert b["output_ids"] == a["output_ids"]
        assert a["meta_info"]["spec_verify_ct"] > 0  # speculation ran
        for key in ("spec_verify_ct", "spec_num_correct_drafts"):
            assert b["meta_info"].get(key) == a["meta_info"].get(key), key
    steps = lambda run: [(s["bs"], s["verify_lens"], s["accepted"]) for s in run["trace"]]
    assert steps(ref) and steps(tri) == steps(ref)


def test_triton_kernels_keep_the_draft_confidences(runs):
    ref, tri = runs["reference"], runs["triton"]
    for a, b in zip(ref["trace"], tri["trace"], strict=True):
        assert a["confidence"] is not None
        # every round drafted (a plain round's confidences are all 0): nothing to compare else
        assert torch.tensor(a["confidence"]).any() and torch.tensor(b["confidence"]).any()
        torch.testing.assert_close(torch.tensor(b["confidence"]), torch.tensor(a["confidence"]),
                                   rtol=0, atol=CONFIDENCE_ABS)  # fmt: skip
