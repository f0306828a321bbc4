"""`cpu_plain_rounds` on the embedded server: a round that does not draft is a plain decode.

A DSPARK server that never drafts (`SGLANG_DSPARK_PLAIN_ROUNDS=always`) commits one token a
round and answers greedy requests with the plain server's tokens; the shipped default
(`auto`), which switches between drafted and plain rounds by their measured rates, answers
with them too (lossless whichever rounds it took) and says at start-up that it is on.
float32, as tests/test_serving.py's greedy equality: in bf16 a verify window and a decode
step round their matmuls differently and near-ties may flip.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from conftest import eval_prompts

from sglang_dspark.plugin import plain_rounds

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _greedy(server, prompts, n=40):
    """(output ids, verify count, completion tokens) per prompt, the prompts sent at once: the
    float32 engine is batch-invariant (`cpu_half_gemm_fp32` with one row minimum), so each
    request's tokens are those it gets alone, and `auto` meets batches of every size."""

    def one(prompt):
        body = {"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n,
                                                    "ignore_eos": True}}  # fmt: skip
        r = requests.post(server.base_url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        meta = r.json()["meta_info"]
        return r.json()["output_ids"], meta.get("spec_verify_ct"), meta["completion_tokens"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def test_plain_rounds_decode_the_plain_servers_tokens(servers, embedded_paths):
    prompts = eval_prompts("gsm8k", 2) + eval_prompts("mt-bench", 2)
    plain = _greedy(servers.get(embedded_paths, dtype="float32", speculative=False), prompts)
    never = servers.get(embedded_paths, dtype="float32", env={plain_rounds.MODE_ENV: "always"})
    got = _greedy(never, prompts)
    assert [g[0] for g in got] == [p[0] for p in plain]
    # one token a round: the first comes from prefill, each later one from a round
    assert all(verify == tokens - 1 for _, verify, tokens in got), got
    servers.retire(never)  # no other test asks for this one or the next: room in the pool
    auto = servers.get(embedded_paths, dtype="float32", env={plain_rounds.MODE_ENV: "auto"})
    got = _greedy(auto, prompts * 3)
    log = auto.log_path.read_text()
    servers.retire(auto)
    assert [g[0] for g in got] == [p[0] for p in plain] * 3
    assert f"{plain_rounds.MODE_ENV}=auto" in log
