"""DeepSeek-V4 launches SGLang 0.5.23 cannot serve are refused at start-up, with the fix.

The checks (`sglang_dspark/plugin/v4_validation.py`) on config dicts first, then the hook on
bad tiny V4 checkpoints on disk (copies of the tiny V4 with an edited `config.json`, the
weights linked), then real launches: `python -m sglang.launch_server` exits with status 1 and
the message before any weight loads. What unmodified SGLang does with each input is in
docs/deepseek-v4.md ("Refusals").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_dspark.plugin import v4_validation as v4v


@pytest.fixture(scope="session")
def tiny_v4() -> Path:
    from sglang_dspark.v4 import tiny

    return tiny.build_tiny_v4()


@pytest.fixture(scope="session")
def tiny_config(tiny_v4) -> dict:
    return json.loads((tiny_v4 / "config.json").read_text())


def _without_draft(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if not k.startswith("dspark_")}


def _copy(src: Path, out: Path, **changes) -> Path:
    """A copy of checkpoint `src` in `out`: weights and tokenizer linked, config edited
    (a value of None removes the key)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            (out / f.name).symlink_to(f.resolve())
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# ------------------------------------------------------------------ compress ratios
def test_the_tiny_v4_passes(tiny_v4, tiny_config):
    assert v4v.compress_ratio_problems(tiny_config) == []
    names = v4v.local_tensor_names(tiny_v4)
    assert {n.split(".")[1] for n in names if n.startswith("mtp.")} == {"0", "1", "2"}
    assert v4v.draft_problems(tiny_config, tiny_config, tensor_names=names) == []
    assert v4v.draft_problems(tiny_config, tiny_config, block_size=5) == []


def test_unsupported_compress_ratio_names_layer_value_and_supported_set(tiny_config):
    (msg,) = v4v.compress_ratio_problems({**tiny_config, "compress_ratios": [0, 8, 128, 4]})
    assert "layer 1: 8" in msg and "supports [0, 4, 128]" in msg
    assert "Set each layer's ratio to 0 (sliding window only), 4" in msg


def test_v41_ratios_on_a_v4_checkpoint_say_they_are_v41(tiny_config):
    (msg,) = v4v.compress_ratio_problems({**tiny_config, "compress_ratios": [0, 2, 128, 4]})
    assert "layer 1: 2" in msg and "DeepSeek-V4.1 ratios (model_type deepseek_v41" in msg
    v41 = {**tiny_config, "model_type": "deepseek_v41", "compress_ratios": [0, 2, 128, 4]}
    assert v4v.compress_ratio_problems(v41) == []


@pytest.mark.parametrize(
    "ratios, expect",
    [
        ([0, 4, 128], "compress_ratios has 3 entries for 4 layers"),
        (None, "config.json has no compress_ratios list"),
        ([0, "4", 128, 4], "layer 1: '4'"),
        ([0, 4.0, 128, 4], "layer 1: 4.0"),
    ],
)
def test_missing_short_or_mistyped_ratios(tiny_config, ratios, expect):
    cfg = {**tiny_config, "compress_ratios": ratios}
    assert any(expect in m for m in v4v.compress_ratio_problems(cfg))


def test_more_ratios_than_layers_is_fine(tiny_config):
    """DeepSeek's release lists one more ratio (its MTP layer) than num_hidden_layers."""
    assert v4v.compress_ratio_problems({**tiny_config, "compress_ratios": [0, 4, 128, 4, 0]}) == []


# ------------------------------------------------------------------ DSPARK drafts
def _draft_problem(tiny_config, expect, *, target=None, block_size=None, names=None, **change):
    draft = {**tiny_config, **change}
    got = v4v.draft_problems(
        draft, target or tiny_config, block_size=block_size, tensor_names=names
    )
    assert len(got) == 1 and expect in got[0], got
    return got[0]


def test_draft_hidden_size_and_vocabulary_must_be_the_targets(tiny_config):
    _draft_problem(tiny_config, "draft hidden_size 512 differs from the target's 256",
                   hidden_size=512)  # fmt: skip
    _draft_problem(tiny_config, "draft vocab_size 32000 differs from the target vocabulary "
                   "(49152)", vocab_size=32000, dspark_noise_token_id=31999)  # fmt: skip


def test_draft_layer_ids_must_be_target_layers_in_order(tiny_config):
    msg = _draft_problem(tiny_config, "[4] are not layers of this 4-layer target",
                         dspark_target_layer_ids=[1, 2, 4])  # fmt: skip
    assert "ids 0..3" in msg
    _draft_problem(tiny_config, "are not strictly increasing", dspark_target_layer_ids=[3, 1, 2])
    _draft_problem(tiny_config, "are not strictly increasing", dspark_target_layer_ids=[1, 1, 3])
    _draft_problem(tiny_config, "must be a non-empty list", dspark_target_layer_ids=[])


def test_draft_mask_token_markov_rank_and_gamma(tiny_config):
    _draft_problem(tiny_config, "mask token (dspark_noise_token_id) 49152 is outside the target "
                   "vocabulary (49152); set it below 49152", dspark_noise_token_id=49152)  # fmt: skip
    _draft_problem(tiny_config, "needs its Markov head (rank > 0)", dspark_markov_rank=0)
    msg = _draft_problem(tiny_config, "--speculative-dspark-block-size 3 differs from the "
                         "draft's dspark_block_size 5", block_size=3)  # fmt: skip
    assert "Drop the flag" in msg


def test_draft_weights_must_cover_every_stage(tiny_v4, tiny_config):
    names = {n for n in v4v.local_tensor_names(tiny_v4) if not n.startswith("mtp.2.")}
    _draft_problem(tiny_config, "no mtp.{s}.* tensors for stage(s) [2]", names=names)
    target_only = {n for n in names if not n.startswith("mtp.")}
    _draft_problem(tiny_config, "stage(s) [0, 1, 2]", names=target_only)


def test_a_v4_checkpoint_without_dspark_keys_is_no_dspark_draft(tiny_config):
    (msg,) = v4v.draft_problems(_without_draft(tiny_config), tiny_config)
    assert "without dspark_* keys, so it carries no DSpark draft" in msg


def test_several_problems_are_listed_together(tiny_config):
    draft = {**tiny_config, "hidden_size": 512, "dspark_target_layer_ids": [1, 2, 9]}
    assert len(v4v.draft_problems(draft, tiny_config, block_size=7)) == 3


# ------------------------------------------------------------------ the hook, on disk
def _args(model_path, **kw) -> SimpleNamespace:
    base = {
        "model_path": str(model_path), "revision": None, "trust_remote_code": False,
        "speculative_algorithm": None, "speculative_draft_model_path": None,
        "speculative_draft_model_revision": None, "speculative_dspark_block_size": None,
    }  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def bad(tiny_v4, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-v4")
    other = json.loads((tiny_v4 / "config.json").read_text())
    return {
        "ratio": _copy(tiny_v4, root / "ratio", compress_ratios=[0, 8, 128, 4]),
        "layer-ids": _copy(tiny_v4, root / "layer-ids", dspark_target_layer_ids=[1, 2, 4]),
        "no-draft": _copy(tiny_v4, root / "no-draft", **{k: None for k in other if "dspark" in k}),
        "draft-dir": _copy(tiny_v4, root / "draft-dir", hidden_size=512),
    }


def test_hook_passes_the_tiny_v4_plain_and_dspark(tiny_v4):
    v4v.check_v4_launch(_args(tiny_v4), "DeepseekV4ForCausalLM")
    v4v.check_v4_launch(_args(tiny_v4, speculative_algorithm="DSPARK"), "DeepseekV4ForCausalLM")


def test_hook_refuses_each_bad_checkpoint(bad, tiny_v4):
    arch = "DeepseekV4ForCausalLM"
    with pytest.raises(v4v.V4LaunchError, match=r"layer 1: 8.*supports \[0, 4, 128\]"):
        v4v.check_v4_launch(_args(bad["ratio"]), arch)
    with pytest.raises(v4v.V4LaunchError, match=r"bundled DSPARK draft does not fit"):
        v4v.check_v4_launch(_args(bad["layer-ids"], speculative_algorithm="DSPARK"), arch)
    v4v.check_v4_launch(_args(bad["layer-ids"]), arch)  # without DSPARK the draft is unused
    with pytest.raises(v4v.V4LaunchError, match=r"bundles none .*--speculative-draft-model-path"):
        v4v.check_v4_launch(_args(bad["no-draft"], speculative_algorithm="DSPARK"), arch)
    separate = _args(tiny_v4, speculative_algorithm="DSPARK",
                     speculative_draft_model_path=str(bad["draft-dir"]))  # fmt: skip
    with pytest.raises(v4v.V4LaunchError, match=r"draft hidden_size 512 differs"):
        v4v.check_v4_launch(separate, arch)
    with pytest.raises(v4v.V4LaunchError, match=r"carries no DSpark draft"):
        v4v.check_v4_launch(_args(tiny_v4, speculative_algorithm="DSPARK",
                                  speculative_draft_model_path=str(bad["no-draft"])), arch)  # fmt: skip
    gamma = _args(tiny_v4, speculative_algorithm="DSPARK", speculative_dspark_block_size=3)
    with pytest.raises(v4v.V4LaunchError, match=r"block-size 3 differs"):
        v4v.check_v4_launch(gamma, arch)


def test_the_ratio_check_runs_before_resolution_reads_the_config(bad, tiny_v4):
    """At the start of argument resolution (transformers' DeepseekV4Config would raise a bare
    KeyError on the first config read): local V4 checkpoints only."""
    with pytest.raises(v4v.V4LaunchError, match=r"layer 1: 8.*supports \[0, 4, 128\]"):
        v4v.check_v4_target(_args(bad["ratio"]))
    v4v.check_v4_target(_args(tiny_v4))
    v4v.check_v4_target(_args("deepseek-ai/DeepSeek-V4-Flash"))  # a hub id: later, resolved


def test_a_draft_in_the_dspark_subfolder_is_checked(bad, tiny_v4, tmp_path):
    target = _copy(bad["no-draft"], tmp_path / "target")
    _copy(tiny_v4, target / "dspark", dspark_target_layer_ids=[1, 2, 4])
    with pytest.raises(v4v.V4LaunchError, match=r"\[4\] are not layers"):
        v4v.check_v4_launch(_args(target, speculative_algorithm="DSPARK"), "DeepseekV4ForCausalLM")


# ------------------------------------------------------------------ real launches
def _launch(model: Path, extra=(), timeout=600) -> subprocess.CompletedProcess:
    from sglang_dspark.serving.server import free_port

    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
        "--device", "cpu", "--host", "127.0.0.1", "--port", str(free_port()),
        "--disable-cuda-graph", "--max-total-tokens", "8192", "--swa-full-tokens-ratio", "0.5",
        "--max-running-requests", "4", *extra,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env["SGLANG_DSPARK_SPS_PROFILE"] = "0"
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)  # fmt: skip


@pytest.fixture(scope="module")
def no_draft_v4(tmp_path_factory) -> Path:
    """A tiny V4 built without its draft (`build_tiny_v4(with_draft=False)`)."""
    from sglang_dspark.v4 import tiny

    return tiny.build_tiny_v4(tmp_path_factory.mktemp("v4-no-draft") / "ckpt", with_draft=False)


LAUNCHES = {
    "compress-ratio": ("ratio", [], "layer 1: 8"),
    "dspark-layer-ids": ("layer-ids", ["--speculative-algorithm", "DSPARK"],
                         "[4] are not layers of this 4-layer target"),
    "dspark-no-draft": (None, ["--speculative-algorithm", "DSPARK"],
                        "bundles none"),
}  # fmt: skip


@pytest.mark.sglang
@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LAUNCHES))
def test_launch_exits_1_with_the_fix_before_loading(case, bad, request):
    which, extra, message = LAUNCHES[case]
    model = bad[which] if which else request.getfixturevalue("no_draft_v4")
    proc = _launch(model, extra)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert message in proc.stderr and "SGLang was not started" in proc.stderr, proc.stderr[-3000:]
    assert "Load weight begin" not in proc.stdout + proc.stderr


@pytest.mark.sglang
@pytest.mark.slow
def test_page_size_is_forced_to_256(tiny_v4):
    """`--page-size 64` on V4: SGLang's model override declares 256 over it (V4's pool and
    kernels are written for 256), with a log line; nothing to refuse."""
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from sglang.srt.server_args import prepare_server_args\n"
        "from sglang.srt.arg_groups.overrides import resolved_view\n"
        f"a = prepare_server_args(['--model-path', {str(tiny_v4)!r}, '--device', 'cpu', "
        "'--page-size', '64'])\n"
        "a.resolve_once()\n"
        "print('PAGE', a.page_size, resolved_view(a).page_size)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, check=False)  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("PAGE ")), None)
    assert line == "PAGE 64 256", proc.stderr[-3000:]
    assert "setting page_size to 256" in proc.stdout + proc.stderr
