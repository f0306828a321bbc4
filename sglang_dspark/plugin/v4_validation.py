"""`v4_validation`: a DeepSeek-V4 launch SGLang 0.5.23 cannot serve is refused at start-up.

SGLang reads a V4 checkpoint's `config.json` while it resolves the launch arguments, but checks
little of it there; what it does not check fails with a message that does not say what is
wrong, later in the scheduler process, or not at all (probed on the tiny V4 with the plugin,
`docs/deepseek-v4.md` "Refusals"):

| input | upstream 0.5.23 | refused here with |
|---|---|---|
| a `compress_ratios` entry other than 0 / 4 / 128 (1 / 2 are V4.1's) | exit 1 at the first config read with transformers' bare `KeyError: 8` (its `DeepseekV4Config` maps only 0 / 4 / 128 to layer kinds) | the layer, the value, the supported set |
| fewer `compress_ratios` than layers | not probed; SGLang reads `compress_ratios[layer_id]` for every layer | both lengths |
| DSPARK, no bundled draft and no `--speculative-draft-model-path` | exit 1: "DSpark dense speculative decoding requires setting --speculative-draft-model-path" | what a bundled draft is and the three ways to get one |
| DSPARK, a V4 draft of another hidden size | target loads, the draft's load asserts on a shape in the scheduler, launcher killed (-9) | both sizes |
| DSPARK, `dspark_target_layer_ids` the target lacks | starts, dies at the warm-up request: "captured 2 of 3 aux hidden states" (-9) | the ids and the valid range |
| DSPARK, unsorted `dspark_target_layer_ids` | serves; the draft reads its features in layer order, not in the order it was trained on | the order |
| `--speculative-dspark-block-size` other than the draft's `dspark_block_size` | serves with gamma = the flag and a log line "DSpark gamma mismatch" | both values |
| DSPARK, weights without the `mtp.*` tensors the config announces | the scheduler's draft load fails on the missing confidence head (-9) | the stages without weights |
| DSPARK, a V4 checkpoint without `dspark_*` keys as the draft path | the scheduler stops: "DSPARK requires markov_rank > 0 in the draft config" (-9) | that it is no DSpark draft |
| DSPARK, another vocabulary, a mask token outside it, `dspark_markov_rank` 0 | not probed one by one | each problem and its fix |

`--page-size` needs no check: V4's model override declares page 256 over any user value (a
log line, `Use dsv4 attention backend ..., setting page_size to 256`), which is what V4's
pool and kernels are written for.

Two checks, both in the launcher while it resolves the arguments, before any process starts
or any weight loads: the compress ratios of a local checkpoint before
`run_resolution_pipeline` (the first config read would raise transformers' KeyError), the
DSPARK draft (and the ratios of a hub checkpoint) before `apply_deepseek_v4_defaults`, which
SGLang calls for `DeepseekV4ForCausalLM` targets only. Both raise `V4LaunchError`, a
ValueError, as SGLang's own argument errors do: the launcher exits with status 1 and the
message on stderr.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sglang_dspark.plugin.registry import register_before

logger = logging.getLogger(__name__)

# The start of argument resolution: the compress ratios, before transformers' DeepseekV4Config
# parses them (its KeyError is the upstream message). Then V4's defaults: the DSPARK draft.
PIPELINE = "sglang.srt.arg_groups.pipeline.run_resolution_pipeline"
TARGET = "sglang.srt.arg_groups.deepseek_v4_hook.apply_deepseek_v4_defaults"

# The attention kinds SGLang 0.5.23's V4 code builds (`MQALayer`, `deepseek_v4.py`): 0 sliding
# window only, 4 compressor with overlap + C4 indexer, 128 compressor. 1 and 2 are V4.1's
# (`DeepseekV41Compressor`, model_type deepseek_v41, with kv/index source layers).
V4_RATIOS = (0, 4, 128)
V41_RATIOS = (0, 1, 2, 4, 128)
# SGLang's marker of a bundled DSpark draft (`dspark_config.checkpoint_bundles_dspark_draft`).
BUNDLE_KEYS = ("dspark_block_size", "dspark_markov_rank", "dspark_noise_token_id",
               "dspark_target_layer_ids")  # fmt: skip
DRAFT_SUBFOLDER = "dspark"  # `speculative_hook._DSPARK_DRAFT_SUBFOLDER`
V4_ARCH = "DeepseekV4ForCausalLM"


class V4LaunchError(ValueError):
    """SGLang cannot serve this DeepSeek-V4 launch; the message says why and what to do."""


# ----------------------------------------------------------------------------- checks
def compress_ratio_problems(target: Mapping[str, Any]) -> list[str]:
    """Why SGLang 0.5.23 cannot build this V4 target's attention layers; [] when it can."""
    v41 = target.get("model_type") == "deepseek_v41"
    supported = V41_RATIOS if v41 else V4_RATIOS
    kinds = "0 (sliding window only), 4 (C4: compressor + indexer) or 128 (C128: compressor)"
    if v41:
        kinds += ", or V4.1's 1 / 2"
    ratios = target.get("compress_ratios")
    layers = int(target.get("num_hidden_layers") or 0)
    if not isinstance(ratios, (list, tuple)) or not ratios:
        return [
            (
                f"config.json has no compress_ratios list (got {ratios!r}); SGLang reads one "
                f"attention kind per layer from it. Add compress_ratios with {layers} entries, "
                f"each {kinds}, as the checkpoint was trained."
            )
        ]
    out = []
    bad = [(i, r) for i, r in enumerate(ratios) if type(r) is not int or r not in supported]
    if bad:
        listed = ", ".join(f"layer {i}: {r!r}" for i, r in bad)
        v41_hint = (
            " 1 and 2 are DeepSeek-V4.1 ratios (model_type deepseek_v41 with kv/index source "
            "layers), which a deepseek_v4 checkpoint cannot use."
            if not v41 and any(r in (1, 2) for _, r in bad)
            else ""
        )
        out.append(
            f"compress_ratios {list(ratios)} has unsupported entries ({listed}); SGLang "
            f"{'V4.1' if v41 else '0.5.23 DeepSeek-V4'} supports {list(supported)}.{v41_hint} "
            f"Set each layer's ratio to {kinds}, the one its weights were trained with (only "
            "4 and 128 have compressor tensors, only 4 an indexer)."
        )
    if len(ratios) < layers:
        out.append(
            f"compress_ratios has {len(ratios)} entries for {layers} layers "
            f"(num_hidden_layers); SGLang reads one per layer. Give every layer its ratio."
        )
    return out


def bundles_dspark_draft(config: Mapping[str, Any]) -> bool:
    """Whether SGLang treats this checkpoint as carrying a DSpark draft (`dspark_*` keys)."""
    return any(config.get(k) is not None for k in BUNDLE_KEYS)


def missing_draft_message(model_path: str) -> str:
    return (
        f"--speculative-algorithm DSPARK needs a DSpark draft, but the DeepSeek-V4 checkpoint "
        f"{model_path} bundles none (its config.json has none of the keys "
        f"{', '.join(BUNDLE_KEYS)}, and it has no {DRAFT_SUBFOLDER}/ subfolder) and no "
        "--speculative-draft-model-path was given; SGLang was not started. Fix: pass "
        "--speculative-draft-model-path "
        "with a V4 DSpark draft (`sglang-dspark train --drafter dspark-v4` writes RUN/draft), "
        "bundle one into a copy of the checkpoint (`sglang-dspark bundle-v4-draft --target "
        "V4_DIR --draft RUN/draft --out BUNDLED_DIR`; the tiny V4 of `sglang-dspark "
        "setup-tiny-v4` has one unless built with --no-draft), or start without "
        "--speculative-algorithm DSPARK."
    )


def draft_problems(
    draft: Mapping[str, Any],
    target: Mapping[str, Any],
    *,
    block_size: int | None = None,
    tensor_names: set[str] | None = None,
) -> list[str]:
    """Why SGLang 0.5.23 would not serve this V4 DSpark draft (its config.json, the target's
    when bundled) with this V4 target; [] when it would.

    ``block_size``: `--speculative-dspark-block-size` if given. ``tensor_names``: the draft
    checkpoint's tensor names when known (local files), to check that every stage has
    weights."""
    if not bundles_dspark_draft(draft):
        return [
            (
                "it is a DeepSeek-V4 checkpoint without dspark_* keys, so it carries no DSpark "
                "draft (SGLang would take it for an MTP draft, DeepseekV4ForCausalLMNextN, and "
                "stop in the scheduler on its Markov rank 0). Point "
                "--speculative-draft-model-path at a V4 DSpark draft (config.json with dspark_* "
                "keys, mtp.{s}.* tensors: `sglang-dspark train --drafter dspark-v4` writes "
                "one), or serve its MTP layers with --speculative-algorithm EAGLE."
            )
        ]
    out = []
    t_hidden, d_hidden = target.get("hidden_size"), draft.get("hidden_size")
    if d_hidden != t_hidden:
        out.append(
            f"draft hidden_size {d_hidden} differs from the target's {t_hidden}: the draft's "
            f"main_proj reads the target's captured hidden states and it shares the target's "
            "embedding and LM head. Use a draft trained for this target."
        )
    t_vocab, d_vocab = target.get("vocab_size"), draft.get("vocab_size")
    if d_vocab != t_vocab:
        out.append(
            f"draft vocab_size {d_vocab} differs from the target vocabulary ({t_vocab}): its "
            "Markov head must cover exactly the target's vocabulary, whose LM head it shares. "
            "Use a draft trained for this target."
        )
    layers = int(target.get("num_hidden_layers") or 0)
    ids = draft.get("dspark_target_layer_ids")
    if ids is not None:
        out += _layer_id_problems(ids, layers)
    mask = draft.get("dspark_noise_token_id", draft.get("mask_token_id"))
    if mask is not None and isinstance(t_vocab, int) and not 0 <= int(mask) < t_vocab:
        out.append(
            f"mask token (dspark_noise_token_id) {mask} is outside the target vocabulary "
            f"({t_vocab}); set it below {t_vocab}, to the id the draft was trained with."
        )
    rank = int(draft.get("dspark_markov_rank") or 0)
    if rank <= 0:
        out.append(
            f"dspark_markov_rank is {draft.get('dspark_markov_rank')!r}; SGLang's V4 DSpark "
            "draft needs its Markov head (rank > 0). Set it to the rank the draft was trained "
            "with (the shape of mtp.*.markov_head.embed.weight)."
        )
    gamma = draft.get("dspark_block_size")
    if block_size is not None and gamma is not None and int(block_size) != int(gamma):
        out.append(
            f"--speculative-dspark-block-size {block_size} differs from the draft's "
            f"dspark_block_size {gamma}: SGLang builds the V4 draft model with block size "
            f"{gamma} but would run gamma={block_size}. Drop the flag, or use a draft trained "
            f"for gamma={block_size}."
        )
    if tensor_names is not None and isinstance(ids, (list, tuple)) and ids:
        stages = len(ids)
        have = {
            n.split(".", 2)[1] for n in tensor_names if n.startswith("mtp.") and n.count(".") >= 2
        }
        missing = [s for s in range(stages) if str(s) not in have]
        if missing:
            out.append(
                f"its config asks for {stages} draft stages (one per dspark_target_layer_id) "
                f"but its weights have no mtp.{{s}}.* tensors for stage(s) {missing}, which "
                "SGLang would leave uninitialised. Bundle the trained draft's weights "
                "(`sglang-dspark bundle-v4-draft`) or point --speculative-draft-model-path at "
                "the draft directory."
            )
    return out


def _layer_id_problems(ids: Any, layers: int) -> list[str]:
    """SGLang's V4 target captures the output of layer i for each id i (0..L-1), in layer
    order, and the draft needs exactly len(ids) captures ("captured k of m aux hidden states"
    otherwise)."""
    if not isinstance(ids, (list, tuple)) or not ids or any(type(i) is not int for i in ids):
        return [f"dspark_target_layer_ids {ids!r} must be a non-empty list of layer ids."]
    ids = list(ids)
    out = []
    outside = [i for i in ids if not 0 <= i < layers]
    if outside:
        out.append(
            f"dspark_target_layer_ids {ids}: {outside} are not layers of this {layers}-layer "
            f"target (V4 reads the output of layer i itself, ids 0..{layers - 1}), so the draft "
            "would receive fewer features than it has stages and the server would fail at the "
            "first request. Use the ids the draft was trained on, for this target."
        )
    if ids != sorted(set(ids)):
        out.append(
            f"dspark_target_layer_ids {ids} are not strictly increasing: SGLang captures each "
            f"layer once, in layer order ({sorted(set(ids))}), so the draft would read its "
            "features in another order (or fewer) than listed. List each id once, in increasing "
            "order, as in training."
        )
    return out


# ----------------------------------------------------------------------------- files
def _load_config(path: str, revision: str | None, trust_remote_code: bool) -> dict:
    """config.json as a flat dict (a V4.1 `text_config` merged under the top level, as
    SGLang's `normalize_deepseek_v41_config` does)."""
    from sglang_dspark.plugin.draft_validation import load_config

    config = load_config(path, revision, trust_remote_code)
    text = config.get("text_config")
    return {**text, **config} if isinstance(text, dict) else config


def local_tensor_names(path: str | Path) -> set[str] | None:
    """The tensor names of a local safetensors checkpoint (headers only), or None when the
    path is not a local directory with safetensors files."""
    root = Path(path)
    if not root.is_dir():
        return None
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:  # reads the header only
            names.update(f.keys())
    return names


def _refusal(title: str, problems: Sequence[str]) -> V4LaunchError:
    lines = "\n".join(f"  - {p}" for p in problems)
    return V4LaunchError(f"{title}; SGLang was not started:\n{lines}")


# ----------------------------------------------------------------------------- hooks
def check_v4_target(server_args) -> None:
    """Before argument resolution: refuse a local DeepSeek-V4 checkpoint whose compress ratios
    SGLang cannot build. The first config read (`get_config`, early in the pipeline) would
    otherwise end in transformers' `KeyError: 8`."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    local = Path(str(cfg.model_path)) / "config.json"
    if not local.is_file():
        return  # a hub id: checked once resolved, in check_v4_launch
    try:
        target = json.loads(local.read_text())
    except ValueError:
        return  # not ours to judge; SGLang reports an unreadable config itself
    if not isinstance(target, dict) or target.get("model_type") != "deepseek_v4":
        return
    problems = compress_ratio_problems(target)
    if problems:
        raise _refusal(f"DeepSeek-V4 target {cfg.model_path} cannot be served", problems)


def check_v4_launch(server_args, model_arch: str) -> None:
    """Refuse a V4 target (or its DSPARK draft) that SGLang 0.5.23 cannot serve."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    trust = bool(cfg.trust_remote_code)
    target = _load_config(cfg.model_path, cfg.revision, trust)
    problems = compress_ratio_problems(target)
    if problems:
        raise _refusal(f"DeepSeek-V4 target {cfg.model_path} cannot be served", problems)
    if str(cfg.speculative_algorithm or "").upper() != "DSPARK":
        return
    draft_path = cfg.speculative_draft_model_path
    if draft_path is None:
        if bundles_dspark_draft(target):
            draft_path = cfg.model_path
        elif (Path(cfg.model_path) / DRAFT_SUBFOLDER / "config.json").is_file():
            draft_path = str(Path(cfg.model_path) / DRAFT_SUBFOLDER)
        elif Path(cfg.model_path).is_dir():
            raise V4LaunchError(missing_draft_message(cfg.model_path))
        else:
            return  # a hub id: SGLang looks for the dspark/ subfolder there itself
    same = draft_path == cfg.model_path
    draft = (
        target if same else _load_config(draft_path, cfg.speculative_draft_model_revision, trust)
    )
    if (draft.get("architectures") or [None])[0] != V4_ARCH:
        return  # another draft family: dspark_draft_validation / SGLang's own loader
    block = cfg.speculative_dspark_block_size
    problems = draft_problems(
        draft, target, block_size=None if block is None else int(block),
        tensor_names=local_tensor_names(draft_path),
    )  # fmt: skip
    if problems:
        what = "bundled DSPARK draft" if same else f"DSPARK draft {draft_path}"
        raise _refusal(f"The {what} does not fit DeepSeek-V4 target {cfg.model_path}", problems)
    logger.info("sglang-dspark: DeepSeek-V4 DSPARK draft %s fits %s", draft_path, cfg.model_path)


def install() -> None:
    register_before(PIPELINE, check_v4_target)
    register_before(TARGET, check_v4_launch)


HOOKS = {"v4_validation": install}
