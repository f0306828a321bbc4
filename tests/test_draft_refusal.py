"""A draft that does not fit the target is refused at start-up, with what to fix.

Each case launches the real `python -m sglang.launch_server --speculative-algorithm DSPARK`
and expects it to exit before loading weights, with our message. Upstream 0.5.23 starts and
then dies at the first request (or serves wrong features).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from sglang_dspark.serving import embedded
from sglang_dspark.serving.server import free_port

pytestmark = pytest.mark.sglang


def _bad_draft(embedded_paths, tmp_path, **changes):
    cfg = json.loads((embedded_paths.draft / "config.json").read_text())
    cfg.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def _launch(embedded_paths, draft, extra=()):
    from dataclasses import replace

    cmd = embedded.launch_command(
        replace(embedded_paths, draft=draft), port=free_port(), extra=list(extra)
    )
    proc = subprocess.run(
        cmd, env=embedded.launch_env(), capture_output=True, text=True, timeout=600, check=False
    )
    return proc.returncode, proc.stdout + proc.stderr


CASES = {
    "layer-out-of-range": (
        {"target_layer_ids": [1, 8, 14, 20, 29]}, [],
        "target_layer_id 29 is the last layer of this 30-layer target",
    ),
    "mask-token-outside-vocab": (
        {"mask_token_id": 60000}, [],
        "mask_token_id 60000 is outside the target vocabulary (49152); set it below 49152",
    ),
    "gamma-mismatch": (
        {}, ["--speculative-dspark-block-size", "5"],
        "requested block size (gamma) 5 differs from the draft's block_size 7",
    ),
    "hidden-size-mismatch": (
        {"hidden_size": 512}, [],
        "draft hidden_size 512 differs from the target's 576",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_draft_refused_at_startup(case, embedded_paths, tmp_path):
    changes, extra, message = CASES[case]
    code, log = _launch(embedded_paths, _bad_draft(embedded_paths, tmp_path, **changes), extra)
    assert code != 0
    assert "does not fit target" in log and message in log, log[-3000:]
    assert "Load weight begin" not in log  # refused before any model is loaded
