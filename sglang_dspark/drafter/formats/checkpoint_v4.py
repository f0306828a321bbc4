"""V4 DSpark draft checkpoints: SGLang's ``mtp.{s}.…`` tensors, export, bundling, loading.

SGLang 0.5.23 loads a V4 DSpark draft from a DeepSeek-V4 checkpoint directory whose
config.json carries ``dspark_*`` keys (``checkpoint_bundles_dspark_draft``); for a draft model
``ModelConfig`` then picks ``DeepseekV4ForCausalLMDSpark`` (``configs/model_config.py``), whose
``load_weights`` reads the ``mtp.{s}.`` tensors through ``_remap_dspark_weight_name`` and skips
everything else (the target's embedding and LM head are shared). Two layouts work:

- a draft directory (what :func:`save_v4_draft` writes and the trainer exports to
  ``OUT/draft``): the target's config.json with this draft's ``dspark_*`` keys, and a
  ``model.safetensors`` holding the ``mtp.*`` tensors only. Serve with
  ``--speculative-algorithm DSPARK --speculative-draft-model-path OUT/draft``.
- a bundled copy of the target (:func:`bundle_v4_draft`): the target's tensors with its old
  ``mtp.*`` tensors replaced by the draft's, and the new ``dspark_*`` keys. With no
  ``--speculative-draft-model-path`` SGLang then defaults the draft path to the model path
  (``arg_groups/speculative_hook.py``, ``_handle_dspark``).

Tensor names (``tiny.draft_tensors`` writes the same set): per stage s ``mtp.{s}.<decoder
layer>`` under DeepSeek's names (``attn.wq_a``, ``attn.wkv``, ``attn.kv_norm``, ``attn.wo_a``,
``attn.attn_sink``, ``ffn.gate.{weight,bias}``, ``ffn.experts.{e}.w{1,2,3}``,
``ffn.shared_experts.w{1,2,3}``, ``hc_{attn,ffn}_{fn,base,scale}``, ``attn_norm``,
``ffn_norm``), ``mtp.0.main_proj`` [H, m*H] and ``mtp.0.main_norm``; on the last stage
``norm``, ``hc_head_{fn,base,scale}``, ``markov_head.{embed,head}`` [V, r] and
``confidence_head.proj`` [1, H + r]. Dtypes are those of SGLang's parameters
(``v4_names.storage_dtype``: bf16, float32 for mHC, sinks, router bias and confidence head).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_dspark.drafter.config import DraftConfigError
from sglang_dspark.drafter.dspark_v4 import DSparkV4Drafter, V4DraftConfig, is_v4_config
from sglang_dspark.drafter.formats.checkpoint import DraftCheckpointError, read_safetensors
from sglang_dspark.drafter.formats.v4_names import (
    from_deepseek_names,
    storage_dtype,
    to_draft_stage_names,
)

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
_STAGE_PARTS = ("layers.", "hc_head.", "norm.")


def draft_tensors(drafter: DSparkV4Drafter) -> dict[str, torch.Tensor]:
    """The drafter's tensors under SGLang's names, in SGLang's parameter dtypes."""
    state = drafter.trainable_state_dict()
    last = drafter.config.num_stages - 1
    hf = {f"model.{k}": v for k, v in state.items() if k.startswith(_STAGE_PARTS)}
    out = to_draft_stage_names(hf, last)
    out["mtp.0.main_proj.weight"] = state["main_proj.weight"]
    out["mtp.0.main_norm.weight"] = state["main_norm.weight"]
    out[f"mtp.{last}.markov_head.embed.weight"] = state["markov_head.markov_w1.weight"]
    out[f"mtp.{last}.markov_head.head.weight"] = state["markov_head.markov_w2.weight"]
    if "confidence_head.proj.weight" in state:
        out[f"mtp.{last}.confidence_head.proj.weight"] = state["confidence_head.proj.weight"]
    return {n: t.detach().to(storage_dtype(n)).contiguous().cpu() for n, t in sorted(out.items())}


def drafter_state_from_tensors(
    tensors: Mapping[str, torch.Tensor], config: V4DraftConfig
) -> dict[str, torch.Tensor]:
    """The inverse of :func:`draft_tensors`: ``mtp.*`` tensors -> the drafter's state_dict
    (float32). Markov and confidence heads may sit on any stage (SGLang ignores the index)."""
    last = config.num_stages - 1
    ds: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    heads = {"main_proj.weight": "main_proj.weight", "main_norm.weight": "main_norm.weight",
             "markov_head.embed.weight": "markov_head.markov_w1.weight",
             "markov_head.head.weight": "markov_head.markov_w2.weight",
             "confidence_head.proj.weight": "confidence_head.proj.weight"}  # fmt: skip
    for name, t in tensors.items():
        if not name.startswith("mtp."):
            continue
        stage, rest = name.removeprefix("mtp.").split(".", 1)
        if rest in heads:
            state[heads[rest]] = t
        elif rest in ("norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"):
            if int(stage) != last:
                raise DraftCheckpointError(
                    f"{name}: the final norm / hc head belongs to stage {last}"
                )
            ds[rest] = t
        else:
            ds[f"layers.{stage}.{rest}"] = t
    try:
        hf = from_deepseek_names(ds)
    except KeyError as e:
        raise DraftCheckpointError(f"not a V4 DSpark draft tensor: {e}") from e
    state.update({k.removeprefix("model."): v for k, v in hf.items()})
    return {k: v.float() for k, v in state.items()}


def load_v4_draft(draft_dir: str | os.PathLike) -> DSparkV4Drafter:
    """A drafter from a V4 checkpoint directory with a DSpark draft (our export, a bundled
    target such as ``sglang-dspark setup-tiny-v4``'s)."""
    path = Path(draft_dir)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise DraftCheckpointError(f"{cfg_path} does not exist; pass a V4 draft directory.")
    raw = json.loads(cfg_path.read_text())
    if not is_v4_config(raw):
        raise DraftCheckpointError(f"{path} is not a DeepSeek-V4 checkpoint (config.json).")
    config = V4DraftConfig.from_config_json(raw)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update({k: v for k, v in read_safetensors(f).items() if k.startswith("mtp.")})
    if not tensors:
        raise DraftCheckpointError(f"{path} holds no mtp.* tensors: no DSpark draft in it.")
    drafter = DSparkV4Drafter(config)
    state = drafter_state_from_tensors(tensors, config)
    own = drafter.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        raise DraftCheckpointError(
            f"{path}: the draft tensors do not match its config (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]})."
        )
    drafter.load_state_dict(state, strict=True)
    return drafter


def _write_atomically(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS_NAME}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o666 & ~umask)  # save_file's file is private
    os.replace(tmp, out / WEIGHTS_NAME)
    tmp_cfg = out / ".config.json.tmp"
    tmp_cfg.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp_cfg, out / "config.json")


def save_v4_draft(drafter: DSparkV4Drafter, out_dir: str | os.PathLike) -> Path:
    """A draft directory: the target's config.json + ``dspark_*`` keys, ``mtp.*`` tensors."""
    out = Path(out_dir)
    _write_atomically(out, draft_tensors(drafter), drafter.config.config_json())
    logger.info("wrote SGLang DeepSeek-V4 DSpark draft to %s", out)
    return out


def bundle_v4_draft(
    target_dir: str | os.PathLike, draft_dir: str | os.PathLike, out_dir: str | os.PathLike
) -> Path:
    """A copy of the target checkpoint with the draft of ``draft_dir`` bundled in it: the
    target's tensors minus its own ``mtp.*``, plus the draft's, in one ``model.safetensors``
    (meant for small targets: the weights are rewritten), the target's config.json with the
    draft's ``dspark_*`` keys, and the target's other files (tokenizer, generation config)."""
    target, draft, out = Path(target_dir), Path(draft_dir), Path(out_dir)
    if out.resolve() in (target.resolve(), draft.resolve()):
        raise DraftConfigError(f"{out} is an input directory; bundle into a new directory.")
    t_raw = json.loads((target / "config.json").read_text())
    d_raw = json.loads((draft / "config.json").read_text())
    d_cfg = V4DraftConfig.from_config_json(d_raw)
    for key in ("hidden_size", "vocab_size", "num_hidden_layers", "hc_mult"):
        if t_raw.get(key) != d_raw.get(key):
            raise DraftConfigError(
                f"the draft was trained for a target with {key}={d_raw.get(key)}, this target "
                f"has {t_raw.get(key)}; bundle it into the target it was trained against."
            )
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(target.glob("*.safetensors")):
        tensors.update({k: v for k, v in read_safetensors(f).items() if not k.startswith("mtp.")})
    for f in sorted(draft.glob("*.safetensors")):
        tensors.update({k: v for k, v in read_safetensors(f).items() if k.startswith("mtp.")})
    config = {k: v for k, v in t_raw.items() if not k.startswith("dspark_")}
    config.update(d_cfg.to_sglang_dict())
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(target.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json" \
                and not f.name.startswith(".") and not f.name.endswith(".index.json"):  # fmt: skip
            shutil.copyfile(f, out / f.name)
    _write_atomically(out, tensors, config)
    logger.info("bundled the draft of %s into a copy of %s at %s", draft, target, out)
    return out


# ---------------------------------------------------------------------------- CLI
def add_bundle_arguments(parser: argparse.ArgumentParser) -> None:
    """``sglang-dspark bundle-v4-draft --target T --draft D --out O``."""
    parser.add_argument("--target", required=True, help="the DeepSeek-V4 target directory")
    parser.add_argument("--draft", required=True, help="a V4 draft directory (OUT/draft)")
    parser.add_argument("--out", required=True, help="new directory for the bundled copy")


def run_bundle(args: argparse.Namespace) -> int:
    print(bundle_v4_draft(args.target, args.draft, args.out))
    return 0
