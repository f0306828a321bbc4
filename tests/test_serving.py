"""The embedded default served by a real SGLang 0.5.23 on CPU, with and without DSPARK."""

from __future__ import annotations

import json

import pytest
import requests
from conftest import eval_prompts

from sglang_dspark.serving.client import chat_prompt_ids, generate_many

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

PROMPTS = eval_prompts("gsm8k", 7) + eval_prompts("humaneval", 7) + eval_prompts("mt-bench", 6)


@pytest.fixture(scope="module")
def tokenizer(embedded_paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_paths.target)


def _greedy(server, prompt_ids, max_new_tokens=40):
    out = generate_many(
        server.base_url, prompt_ids, concurrency=8, max_new_tokens=max_new_tokens, temperature=0
    )
    return [o["output_ids"] for o in out], [o["meta_info"] for o in out]


def test_server_info_reports_mtp1_baseline(servers, embedded_paths):
    info = requests.get(servers.get(embedded_paths, arm="mtp1").base_url + "/server_info").json()
    assert info["speculative_algorithm"] == "EAGLE3"
    assert (info["speculative_num_steps"], info["speculative_eagle_topk"]) == (1, 1)
    assert info["speculative_num_draft_tokens"] == 2
    assert info["speculative_draft_model_path"] == str(embedded_paths.mtp1_draft)


def test_server_info_reports_dspark(servers, embedded_paths):
    server = servers.get(embedded_paths)
    info = requests.get(server.base_url + "/server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "DSPARK"
    assert info["device"] == "cpu"


def test_embedded_server_memory_under_4gb(servers, embedded_paths, tokenizer):
    server = servers.get(embedded_paths)
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in PROMPTS[:8]]
    generate_many(server.base_url, prompt_ids, concurrency=8, max_new_tokens=32)
    pss = server.memory_pss_mb()
    assert 500 < pss < 4096, f"embedded server uses {pss:.0f} MB (PSS over its processes)"


def test_compare_measures_the_served_tau_of_running_servers(servers, embedded_paths, tmp_path):
    """`sglang-dspark compare --server-url`: the same prompts through the offline evaluator and
    through SGLang serving DSPARK and the MTP-1 baseline; the plain server has no rounds."""
    import argparse

    from sglang_dspark.evaluation import compare

    dspark = servers.get(embedded_paths)
    mtp1 = servers.get(embedded_paths, arm="mtp1")
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args([
        "--target", str(embedded_paths.target), "--out", str(tmp_path),
        "--draft", f"dspark={embedded_paths.draft}", "--draft", f"mtp1={embedded_paths.mtp1_draft}",
        "--server-url", f"dspark={dspark.base_url}", "--server-url", f"mtp1={mtp1.base_url}",
        "--benchmarks", "gsm8k", "--limit", "2", "--max-new-tokens", "24", "--temperatures", "0",
        "--no-progress",
    ])  # fmt: skip
    assert compare.run(args) == 0
    rows = json.loads((tmp_path / "comparison.json").read_text())["rows"]
    assert [r["benchmark"] for r in rows] == ["gsm8k", "all"]
    for r in rows:
        assert 1.0 <= r["server_tau"]["mtp1"] <= 2.0
        assert 1.0 <= r["server_tau"]["dspark"] <= 8.0
        assert 1.0 <= r["tau"]["mtp1"] <= 2.0 and 1.0 <= r["tau"]["dspark"] <= 8.0
    plain = servers.get(embedded_paths, speculative=False)
    served = compare.served_tau(plain.base_url, {"gsm8k": [[1, 2, 3]]}, [0.0], 8)
    assert served == {"0": {"gsm8k": None, "all": None}}


def test_dspark_serves_in_bfloat16(servers, embedded_paths, tokenizer):
    """bf16, the embedded default's dtype: DSPARK's first tokens equal the plain server's
    (later near-ties may round differently in a verify window and a decode step)."""
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in PROMPTS[:4]]
    plain, _ = _greedy(servers.get(embedded_paths, speculative=False), prompt_ids, 24)
    spec, meta = _greedy(servers.get(embedded_paths), prompt_ids, 24)
    assert all(m["spec_verify_ct"] > 0 for m in meta)
    for a, b in zip(plain, spec):
        assert a[:4] == b[:4]
    texts = [tokenizer.decode(ids) for ids in spec]
    assert all(t.strip() for t in texts)


def test_dspark_drafts_from_the_shipped_draft_vocabulary(servers, embedded_paths, tokenizer):
    """The shipped drafter carries its reduced draft vocabulary (`draft_vocab/`), and the
    embedded server drafts from it without being told to."""
    from sglang_dspark.drafter.formats.draft_vocab import FILE_NAME, load_draft_vocab

    ids = load_draft_vocab(embedded_paths.draft / FILE_NAME, 49152)
    assert 0 < len(ids) < 49152
    server = servers.get(embedded_paths)
    _, meta = _greedy(server, [chat_prompt_ids(tokenizer, PROMPTS[0])], 16)
    assert meta[0]["spec_verify_ct"] > 0
    assert f"DSpark draft vocabulary: {len(ids)} of 49152 tokens" in server.log_text()


def test_greedy_dspark_equals_plain_token_for_token(servers, embedded_paths, tokenizer):
    """20 eval prompts: DSPARK greedy output == the same server's greedy output without it.

    float32, so that a verify window and a single decode step compute the same logits; in
    bf16 the two matmul shapes round differently and near-ties may flip (see README).
    """
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in PROMPTS]
    assert len(prompt_ids) == 20
    plain, _ = _greedy(servers.get(embedded_paths, dtype="float32", speculative=False), prompt_ids)
    spec, meta = _greedy(servers.get(embedded_paths, dtype="float32"), prompt_ids)
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, (
            f"prompt {i}: DSPARK diverged at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y) if any(x != y for x, y in zip(a, b)) else min(len(a), len(b))}"
        )
    # speculation really ran: every request went through DSPARK verify rounds
    assert all(m.get("spec_verify_ct", 0) > 0 for m in meta)


def test_greedy_mtp1_baseline_equals_plain_token_for_token(servers, embedded_paths, tokenizer):
    """The MTP-1 baseline (SGLang's EAGLE3 worker, one draft token per round, on CPU through
    the plugin's EAGLE hooks): same 20 prompts, same float32 equality with the plain server."""
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in PROMPTS]
    plain, _ = _greedy(servers.get(embedded_paths, dtype="float32", speculative=False), prompt_ids)
    spec, meta = _greedy(servers.get(embedded_paths, dtype="float32", arm="mtp1"), prompt_ids)
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, f"prompt {i}: MTP-1 diverged from plain decoding"
    assert all(m.get("spec_verify_ct", 0) > 0 for m in meta)
    # one draft per round: each round commits 1 or 2 tokens, and some drafts were accepted
    assert all(1.0 <= m["spec_accept_length"] <= 2.0 for m in meta)
    assert sum(m["completion_tokens"] - m["spec_verify_ct"] for m in meta) > 0


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "dspark"])
def test_openai_endpoints_stream_and_not(servers, embedded_paths, speculative):
    # float32: a cached prefix and a fresh prefill then give the same greedy tokens, so the
    # streamed and the non-streamed answers can be compared exactly
    server = servers.get(embedded_paths, dtype="float32", speculative=speculative)
    chat = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
            "temperature": 0, "model": "default"}  # fmt: skip
    r = requests.post(server.base_url + "/v1/chat/completions", json=chat, timeout=300)
    r.raise_for_status()
    content = r.json()["choices"][0]["message"]["content"]
    assert content.strip()

    r = requests.post(
        server.base_url + "/v1/chat/completions", json={**chat, "stream": True}, stream=True,
        timeout=300,
    )  # fmt: skip
    pieces = []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            delta = json.loads(line[6:])["choices"][0]["delta"]
            pieces.append(delta.get("content") or "")
    assert "".join(pieces) == content

    comp = {"prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0, "model": "default"}
    r = requests.post(server.base_url + "/v1/completions", json=comp, timeout=300)
    r.raise_for_status()
    text = r.json()["choices"][0]["text"]
    r = requests.post(
        server.base_url + "/v1/completions", json={**comp, "stream": True}, stream=True,
        timeout=300,
    )  # fmt: skip
    streamed = "".join(
        json.loads(line[6:])["choices"][0]["text"]
        for line in r.iter_lines()
        if line.startswith(b"data: ") and line != b"data: [DONE]"
    )
    assert streamed == text and text.strip()


def test_dspark_serves_in_float16(servers, embedded_paths, tokenizer):
    """fp16 (10 mantissa bits, closer to float32 than bf16's 7): DSPARK's first tokens equal
    the float32 plain server's, already running for the equality tests above."""
    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in PROMPTS[:4]]
    plain_server = servers.get(embedded_paths, dtype="float32", speculative=False)
    plain, _ = _greedy(plain_server, prompt_ids, 24)
    spec, meta = _greedy(servers.get(embedded_paths, dtype="float16"), prompt_ids, 24)
    assert all(m["spec_verify_ct"] > 0 for m in meta)
    for a, b in zip(plain, spec):
        assert a[:4] == b[:4]
    texts = [tokenizer.decode(ids) for ids in spec]
    assert all(t.strip() for t in texts)


def test_mtp1_baseline_refuses_a_tree_on_cpu(embedded_paths, tmp_path):
    """topk > 1 needs tree attention, which the CPU verify path does not have: refused at
    start-up with the fix, before any weights load."""
    import subprocess

    from sglang_dspark.serving import embedded

    cmd = embedded.launch_command(embedded_paths, port=1, arm="mtp1")
    # rejection sampling is itself refused with topk > 1 (by SGLang, with its own message);
    # this test is about the tree.
    cmd.remove("--speculative-use-rejection-sampling")
    i = cmd.index("--speculative-eagle-topk")
    cmd[i + 1] = "4"
    cmd[cmd.index("--speculative-num-steps") + 1] = "3"
    cmd[cmd.index("--speculative-num-draft-tokens") + 1] = "8"
    proc = subprocess.run(
        cmd, env=embedded.launch_env(), capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode != 0
    assert "--speculative-num-steps 1 --speculative-eagle-topk 1" in proc.stderr + proc.stdout
