"""The draft pass drafts only what Algorithm 1 can verify (`cpu_draft_until_verifiable`).

Two embedded DSPARK servers with the same seed and the same SPS table, one with the early
stop (the default) and one without (`SGLANG_DSPARK_DRAFT_EARLY_STOP=0`), answer the same
requests one at a time at T=1 and T=0: the same tokens, the same verify windows, the same
accepted drafts. Both draft over the full vocabulary: the pass without the early stop is
SGLang's own, which knows no draft vocabulary (a 16k proposal samples other tokens at T=1). The early-stopping server's trace shows positions it did not draft (their
confidence is exactly 0, which the head's sigmoid never gives): exactly the longest verified
window of each step is drafted.
"""

from __future__ import annotations

import json

import pytest
import requests
from conftest import eval_prompts

from sglang_dspark.plugin import cpu_draft
from sglang_dspark.scheduling.scheduler import save_sps_table, sps_table_from_points

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


def _trace(stem) -> list[dict]:
    lines = []
    for path in sorted(stem.parent.glob(stem.name + ".rank*.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return lines


def test_early_stop_drafts_less_and_changes_no_token(servers, embedded_paths, tmp_path):
    # verifying costs 1/6 of a step per extra token at one request: windows of 1-4 drafts
    table = tmp_path / "sps.json"
    save_sps_table(sps_table_from_points(list(range(1, 65)),
                                         [1.0 / (0.05 + 0.01 * b) for b in range(1, 65)]), table)  # fmt: skip
    extra = ("--speculative-dspark-sps-table-path", str(table), "--random-seed", "7")
    arms = {}
    for name, switch in (("on", "1"), ("off", "0")):
        stem = tmp_path / f"trace-{name}"
        env = {
            cpu_draft.SWITCH_ENV: switch,
            cpu_draft.VOCAB_ENV: "full",
            "SGLANG_DSPARK_VERIFY_TRACE": str(stem),
        }
        arms[name] = (servers.get(embedded_paths, extra=extra, env=env), stem)
    prompts = eval_prompts("gsm8k", 2) + eval_prompts("mt-bench", 2)
    outputs = {}
    for name, (server, _) in arms.items():
        outs = []
        for temperature in (1.0, 0.0):
            for prompt in prompts:  # one at a time: the same random stream in both servers
                body = {"text": prompt,
                        "sampling_params": {"temperature": temperature, "max_new_tokens": 32}}  # fmt: skip
                r = requests.post(server.base_url + "/generate", json=body, timeout=600)
                r.raise_for_status()
                meta = r.json()["meta_info"]
                outs.append((r.json()["output_ids"], meta.get("spec_num_correct_drafts")))
        outputs[name] = outs
    on, off = (_trace(arms[k][1]) for k in ("on", "off"))
    for server, _ in arms.values():  # no other test asks for these two: room in the pool
        servers.retire(server)
    assert outputs["on"] == outputs["off"]
    assert len(on) == len(off) > 0
    assert [s["verify_lens"] for s in on] == [s["verify_lens"] for s in off]
    assert [s["accepted"] for s in on] == [s["accepted"] for s in off]
    # it drafts exactly the longest window the step verifies (later confidences are 0)
    drafted = [sum(c > 0.0 for c in s["confidence"][0]) for s in on]
    assert drafted == [max(s["verify_lens"]) - 1 for s in on]
    assert min(drafted) < 7  # the early stop really stopped
    assert all(c > 0.0 for s in off for row in s["confidence"] for c in row)
