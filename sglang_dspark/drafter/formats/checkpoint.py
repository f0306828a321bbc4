"""Draft checkpoints: SGLang export, DeepSpec import, validation and random init.

An SGLang DSpark draft directory is ``config.json`` (see ``config.py``) plus
``model.safetensors`` holding exactly the :class:`DSparkDrafter` state_dict: ``fc.weight``
[H, m*H], ``hidden_norm.weight``, ``norm.weight``, ``layers.i.self_attn.{q,k,v,o}_proj.weight``,
``layers.i.self_attn.{q,k}_norm.weight``, ``layers.i.mlp.{gate,up,down}_proj.weight``,
``layers.i.{input,post_attention}_layernorm.weight``, ``markov_head.markov_w1.weight`` [V, r],
``markov_head.markov_w2.weight`` [V, r] (+ ``gate_proj`` / ``joint_proj`` for gated / rnn),
``confidence_head.proj.{weight,bias}``. No embedding, no LM head: SGLang shares the target's.
So export is a save, and loading our own export goes through the same validation as a
DeepSpec checkpoint (which additionally carries ``embed_tokens`` / ``lm_head`` and may prefix
names with ``model.``; both are handled here).

An SGLang MTP-1 draft (``mtp.py``, served by the EAGLE3 worker as ``LlamaForCausalLMEagle3``)
is ``config.json`` (:meth:`MtpDraftConfig.to_sglang_dict`) plus ``model.safetensors`` holding
``layers.0.self_attn.{q,k,v,o}_proj.weight`` (q/k/v read the 2H-wide [e; h] input),
``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``layers.0.mlp.{gate,up,down}_proj.weight`` and ``norm.weight``; see the MTP section below.

Only safetensors are read from checkpoints; pickles never. Training checkpoints (our own,
for resume) are loaded with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang_dspark.drafter.config import (
    DraftConfigError,
    DSparkDraftConfig,
    _as_dict,
    validate_draft_for_target,
)
from sglang_dspark.drafter.model import DSparkDrafter, init_weights
from sglang_dspark.drafter.mtp import SGLANG_MTP_ARCHITECTURE as MTP_ARCHITECTURE
from sglang_dspark.drafter.mtp import MtpDraftConfig, MtpDrafter, is_mtp_config
from sglang_dspark.drafter.training.target import load_target_config

logger = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
# Names SGLang skips (shared with the target / recomputed); DeepSpec checkpoints carry them.
_SHARED_PREFIXES = ("embed_tokens.", "lm_head.", "rotary_emb.")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class DraftCheckpointError(ValueError):
    """A draft checkpoint that cannot be used; the message says what is wrong and what to do."""


# ---------------------------------------------------------------------------- reading
def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of one safetensors file, with a clear error for a damaged file."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except Exception as e:  # safetensors raises SafetensorError / OSError / ValueError
        size = path.stat().st_size if path.exists() else 0
        raise DraftCheckpointError(
            f"{path} ({size} bytes) is not a readable safetensors file: {e}. It is probably "
            "truncated (an interrupted copy or export) or not a safetensors file at all; "
            "re-export or re-copy it."
        ) from e


def _weight_files(draft_dir: Path) -> list[Path]:
    index = draft_dir / f"{WEIGHTS_NAME}.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise DraftCheckpointError(
                f"{index} is not a valid safetensors index ({e}); re-export the checkpoint."
            ) from e
        files = sorted({draft_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DraftCheckpointError(
                f"{index} lists shards that do not exist: {missing}; copy the whole directory."
            )
        return files
    files = sorted(draft_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in draft_dir.glob("*.bin")) + sorted(
            p.name for p in draft_dir.glob("*.pt")
        )
        hint = (
            f" It has {pickles}: pickle files are never loaded (they can run code); convert "
            "them to safetensors with the tool that wrote them."
            if pickles
            else ""
        )
        raise DraftCheckpointError(f"{draft_dir} contains no *.safetensors weights.{hint}")
    return files


def read_checkpoint_tensors(draft_dir: str | Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in _weight_files(Path(draft_dir)):
        tensors.update(read_safetensors(f))
    return tensors


def _normalize_names(
    tensors: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Strip a ``model.`` prefix; split off the shared embedding / LM head."""
    own, shared = {}, {}
    for name, t in tensors.items():
        n = name.removeprefix("model.")
        (shared if n.startswith(_SHARED_PREFIXES) else own)[n] = t
    return own, shared


def _check_tensors(
    config: DSparkDraftConfig, tensors: Mapping[str, torch.Tensor], *, source: str
) -> None:
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in DSparkDrafter(config).state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = []
    conf_missing = [n for n in missing if n.startswith("confidence_head.")]
    if conf_missing:
        problems.append(
            f"missing confidence head tensors {conf_missing}: SGLang 0.5.23 builds the confidence "
            "head in cap-accept/compact modes even when enable_confidence_head is false, and "
            "refuses to start without trained weights. Train with the confidence loss."
        )
        missing = [n for n in missing if n not in conf_missing]
    if missing:
        problems.append(
            f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
            f"({len(missing)} in all): the checkpoint does not match its config.json "
            f"(num_hidden_layers={config.num_hidden_layers}, "
            f"markov_head_type={config.markov_head_type!r}); re-export it."
        )
    if unexpected:
        problems.append(
            f"unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}: "
            "they belong to no layer of the drafter config.json describes (wrong "
            "num_hidden_layers / markov_head_type, or not a DSpark draft)."
        )

    def why(name: str) -> str:
        if name == "fc.weight":
            return (
                f" fc.weight is [H, m*H] with m = len(target_layer_ids) = "
                f"{config.num_context_features}; config.json and the weights disagree on m."
            )
        if name.startswith("markov_head.markov_w"):
            return (
                f" The Markov head covers vocab_size={config.vocab_size} x "
                f"markov_rank={config.markov_rank}; fix vocab_size / markov_rank in config.json."
            )
        return ""

    problems += _shape_problems(expected, tensors, why)
    if problems:
        raise DraftCheckpointError(f"{source}: " + " ".join(problems))


# ---------------------------------------------------------------------------- writing
def save_draft(
    drafter: DSparkDrafter, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write an SGLang-loadable draft (config.json + model.safetensors), atomically."""
    state = {k: v.to(dtype).contiguous().cpu() for k, v in drafter.trainable_state_dict().items()}
    _check_tensors(drafter.config, state, source="export")
    return _write_draft(out_dir, state, drafter.config.to_sglang_dict(), dtype, kind="DSpark")


def _write_draft(
    out_dir: str | Path, state: dict[str, torch.Tensor], raw_config: dict[str, Any],
    dtype: torch.dtype, *, kind: str,
) -> Path:  # fmt: skip
    """model.safetensors, then config.json, each written to a temporary name and renamed, so
    an interrupted export never leaves a half-written file under the real name."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{WEIGHTS_NAME}.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / WEIGHTS_NAME)
    raw = dict(raw_config, torch_dtype={v: k for k, v in _DTYPES.items()}[dtype])
    tmp_cfg = out / ".config.json.tmp"
    tmp_cfg.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    os.replace(tmp_cfg, out / "config.json")
    logger.info("wrote SGLang %s draft to %s (%d tensors)", kind, out, len(state))
    return out


def _shape_problems(
    expected: Mapping[str, tuple[int, ...]], tensors: Mapping[str, torch.Tensor], why
) -> list[str]:
    """One line per tensor whose shape differs from the model's, with ``why(name)`` appended."""
    out = []
    for name in sorted(set(expected) & set(tensors)):
        got, want = tuple(tensors[name].shape), expected[name]
        if got != want:
            out.append(f"{name} has shape {list(got)}, expected {list(want)}.{why(name)}")
    return out


# ---------------------------------------------------------------------------- loading
def load_draft(
    draft_dir: str | Path,
    *,
    target_config: Any = None,
    block_size: int | None = None,
) -> DSparkDrafter:
    """Load an SGLang- or DeepSpec-format draft directory into a :class:`DSparkDrafter`.

    With ``target_config`` (HF config / config.json dict / target directory) the draft is
    also checked against the target (:func:`validate_draft_for_target`).
    """
    draft_dir = Path(draft_dir)
    if is_mtp_config(_read_config_json(draft_dir)):
        raise DraftCheckpointError(
            f"{draft_dir} is an MTP-1 draft ({MTP_ARCHITECTURE}), not a DSpark one; load it "
            "with load_mtp_draft (or train it with --drafter mtp)."
        )
    try:
        config = DSparkDraftConfig.load(draft_dir)
        config.check()
    except DraftConfigError as e:
        raise DraftCheckpointError(f"{draft_dir}: {e}") from e
    own, shared = _normalize_names(read_checkpoint_tensors(draft_dir))
    if target_config is not None:
        if isinstance(target_config, (str, Path)):
            target_config = load_target_config(target_config)
        problems = validate_draft_for_target(config, target_config, block_size=block_size)
        embed = shared.get("embed_tokens.weight")
        t_vocab = int(_as_dict(target_config).get("vocab_size") or 0)
        if embed is not None and embed.shape[0] != t_vocab:
            problems.append(
                f"the checkpoint's embed_tokens has {embed.shape[0]} rows but the target "
                f"vocabulary has {t_vocab}; this drafter was trained for another target."
            )
        if problems:
            raise DraftCheckpointError(
                f"{draft_dir} does not fit the target:\n  - " + "\n  - ".join(problems)
            )
    _check_tensors(config, own, source=str(draft_dir))
    drafter = DSparkDrafter(config)
    drafter.load_state_dict({k: v.float() for k, v in own.items()}, strict=True)
    return drafter


def import_deepspec(
    src_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    target_dir: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> DSparkDrafter:
    """Load a DeepSpec (``deepspec.modeling.dspark.qwen3``) checkpoint; with ``out_dir``,
    write it as an SGLang draft. DeepSpec stores the full Qwen3 config plus the DSpark keys
    and a state_dict that includes the (frozen) embedding and LM head; those are dropped."""
    drafter = load_draft(src_dir, target_config=target_dir)
    if out_dir is not None:
        save_draft(drafter, out_dir, dtype=dtype)
    return drafter


def load_training_checkpoint(path: str | Path) -> dict[str, Any]:
    """Our own resume checkpoint (``train.py``), loaded without unpickling code."""
    path = Path(path)
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as e:
        raise DraftCheckpointError(
            f"{path} is not a readable training checkpoint ({e}); it may be truncated. "
            "Resume from an earlier checkpoint or re-run training."
        ) from e


def drafter_from_training_checkpoint(path: str | Path) -> DSparkDrafter | MtpDrafter:
    state = load_training_checkpoint(path)
    if "draft_config" not in state or "model" not in state:
        raise DraftCheckpointError(
            f"{path} is not a sglang-dspark training checkpoint (no draft_config / model)."
        )
    if is_mtp_config(state["draft_config"]):
        mtp_config = MtpDraftConfig.from_dict(state["draft_config"])
        _check_mtp_tensors(mtp_config, state["model"], source=str(path))
        mtp = MtpDrafter(mtp_config)
        mtp.load_state_dict(state["model"], strict=True)
        return mtp
    config = DSparkDraftConfig.from_dict(state["draft_config"])
    drafter = DSparkDrafter(config)
    _check_tensors(config, state["model"], source=str(path))
    drafter.load_state_dict(state["model"], strict=True)
    return drafter


def export(
    src: str | Path,
    out_dir: str | Path,
    *,
    target_dir: str | Path | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Write an SGLang draft from ``src``: a training checkpoint (``*.pt``), a training run
    directory (uses ``checkpoints/latest.pt``), or a draft directory (SGLang / DeepSpec)."""
    src = Path(src)
    if src.is_dir() and (src / "checkpoints" / "latest.pt").is_file():
        src = src / "checkpoints" / "latest.pt"
    if src.is_file():
        drafter = drafter_from_training_checkpoint(src)
        if target_dir is not None:
            target_config = load_target_config(target_dir)
            problems = (
                drafter.config.problems_for_target(target_config)
                if isinstance(drafter, MtpDrafter)
                else validate_draft_for_target(drafter.config, target_config)
            )
            if problems:
                raise DraftCheckpointError("\n  - ".join([f"{src}:"] + problems))
    elif src.is_dir() and is_mtp_config(_read_config_json(src)):
        drafter = load_mtp_draft(src, target_config=target_dir)
    elif src.is_dir():
        drafter = load_draft(src, target_config=target_dir)
    else:
        raise DraftCheckpointError(
            f"{src} does not exist; pass a training checkpoint (.pt), a training output "
            "directory or a draft directory."
        )
    if isinstance(drafter, MtpDrafter):
        return save_mtp_draft(drafter, out_dir, dtype=dtype)
    return save_draft(drafter, out_dir, dtype=dtype)


def validate_checkpoint(draft_dir: str | Path, target_dir: str | Path | None = None) -> list[str]:
    """Everything wrong with a draft directory (empty when it loads and fits the target)."""
    try:
        if is_mtp_config(_read_config_json(Path(draft_dir))):
            load_mtp_draft(draft_dir, target_config=target_dir)
        else:
            load_draft(draft_dir, target_config=target_dir)
    except (DraftCheckpointError, DraftConfigError) as e:
        return [str(e)]
    return []


def init_random_draft(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    block_size: int = 7,
    num_layers: int = 1,
    markov_rank: int = 256,
    markov_head_type: str = "vanilla",
    target_layer_ids: Sequence[int] | None = None,
    num_context_features: int | None = None,
    mask_token_id: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A randomly initialised SGLang-loadable draft shaped for the target in ``target_dir``
    (written with the same code path as a trained export)."""
    target_config = load_target_config(target_dir)
    config = DSparkDraftConfig.for_target(
        target_config,
        num_layers=num_layers,
        block_size=block_size,
        markov_rank=markov_rank,
        markov_head_type=markov_head_type,
        target_layer_ids=target_layer_ids,
        num_context_features=num_context_features,
        mask_token_id=mask_token_id,
    )
    problems = validate_draft_for_target(config, target_config)
    if problems:
        raise DraftConfigError("cannot build this draft:\n  - " + "\n  - ".join(problems))
    drafter = DSparkDrafter(config)
    init_weights(drafter, seed=seed)
    return save_draft(drafter, out_dir, dtype=dtype)


# ---------------------------------------------------------------------------- MTP-1 drafts
# Legacy names SGLang's LlamaForCausalLMEagle3.load_weights rewrites (EAGLE / SpecForge).
_MTP_LEGACY_NAMES = {"midlayer.": "layers.0."}
# fc.weight: SGLang builds fc [H, 3H] (3 = its default aux-layer count) but
# LlamaModel.forward applies it only when the incoming hidden width differs from H, which
# never happens with use_aux_hidden_state false (the target hands over its final hidden
# state, width H). It is therefore not exported (a tensor nobody reads would only suggest it
# matters) and ignored when another tool's export carries it.
_MTP_IGNORED = ("fc.weight", "fc.bias")


def _read_config_json(draft_dir: Path) -> dict[str, Any]:
    """config.json as a dict, or {} when absent / unreadable (the loaders report that)."""
    try:
        return json.loads((Path(draft_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _check_mtp_tensors(
    config: MtpDraftConfig, tensors: Mapping[str, torch.Tensor], *, source: str
) -> None:
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in MtpDrafter(config).state_dict().items()}
    problems = []
    missing = sorted(set(expected) - set(tensors))
    if missing:
        problems.append(
            f"missing tensors {missing}: SGLang would leave these parameters uninitialised and "
            "serve garbage without an error. Re-export the draft with `sglang-dspark export`."
        )
    reduced = sorted(n for n in tensors if n in ("d2t", "t2d"))
    if reduced:
        problems.append(
            f"{reduced}: a reduced draft vocabulary (hot-token map) is not supported; this "
            "drafter predicts over the full target vocabulary."
        )
    unexpected = sorted(set(tensors) - set(expected) - set(reduced))
    if unexpected:
        problems.append(
            f"unexpected tensors {unexpected[:8]}: they belong to no parameter of a 1-layer "
            "MTP draft (more layers, or not an MTP-1 draft)."
        )

    def why(name: str) -> str:
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            return (
                f" q/k/v read the concatenated [emb; hidden] input, 2 x hidden_size = "
                f"{2 * config.hidden_size} wide; config.json and the weights disagree."
            )
        return ""

    problems += _shape_problems(expected, tensors, why)
    if problems:
        raise DraftCheckpointError(f"{source}: " + " ".join(problems))


def save_mtp_draft(
    drafter: MtpDrafter, out_dir: str | Path, *, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write an SGLang-loadable MTP-1 draft (config.json + model.safetensors), atomically."""
    state = {k: v.to(dtype).contiguous().cpu() for k, v in drafter.trainable_state_dict().items()}
    _check_mtp_tensors(drafter.config, state, source="export")
    return _write_draft(out_dir, state, drafter.config.to_sglang_dict(), dtype, kind="MTP-1")


def load_mtp_draft(draft_dir: str | Path, *, target_config: Any = None) -> MtpDrafter:
    """Load an MTP-1 draft directory (our export, or an EAGLE3-format one without aux
    layers); with ``target_config`` (HF config / dict / target directory) check it fits."""
    draft_dir = Path(draft_dir)
    try:
        config = MtpDraftConfig.load(draft_dir)
        config.check()
    except DraftConfigError as e:
        raise DraftCheckpointError(f"{draft_dir}: {e}") from e
    own, shared = {}, {}
    for name, t in read_checkpoint_tensors(draft_dir).items():
        n = name.removeprefix("model.")
        for legacy, new in _MTP_LEGACY_NAMES.items():
            n = n.replace(legacy, new)
        if n in _MTP_IGNORED:
            continue
        (shared if n.startswith(_SHARED_PREFIXES) else own)[n] = t
    if target_config is not None:
        if isinstance(target_config, (str, Path)):
            target_config = load_target_config(target_config)
        problems = config.problems_for_target(target_config)
        if problems:
            raise DraftCheckpointError(
                f"{draft_dir} does not fit the target:\n  - " + "\n  - ".join(problems)
            )
    _check_mtp_tensors(config, own, source=str(draft_dir))
    drafter = MtpDrafter(config)
    drafter.load_state_dict({k: v.float() for k, v in own.items()}, strict=True)
    return drafter


def init_random_mtp_draft(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """A randomly initialised MTP-1 draft for the target in ``target_dir`` (same init and
    export path as training)."""
    target_config = load_target_config(target_dir)
    config = MtpDraftConfig.for_target(target_config)
    problems = config.problems_for_target(target_config)
    if problems:
        raise DraftConfigError("cannot build this MTP draft:\n  - " + "\n  - ".join(problems))
    drafter = MtpDrafter(config)
    init_weights(drafter, seed=seed)
    return save_mtp_draft(drafter, out_dir, dtype=dtype)


def sglang_mtp_load_check(draft_dir: str | Path):
    """Build SGLang 0.5.23's own ``LlamaForCausalLMEagle3`` on the CPU from
    ``draft_dir``/config.json and run its ``load_weights`` on our safetensors (its name
    mapping, q/k/v and gate/up fusion, shape checks), without a server. Returns the module;
    its forward needs a ForwardBatch and an attention backend (tests use a reference one)."""
    import contextlib
    import importlib
    from types import SimpleNamespace

    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(str(draft_dir))
    rope_base = importlib.import_module("sglang.srt.layers.rotary_embedding.base")
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from sglang.srt.runtime_context import get_context, get_parallel

    single = SimpleNamespace(world_size=1, rank_in_group=0, is_first_rank=True, is_last_rank=True)
    saved_is_cpu = rope_base._is_cpu
    with contextlib.ExitStack() as stack:
        stack.enter_context(get_context().override_server_args(device="cpu"))
        stack.enter_context(get_parallel().override(pp_group=single, tp_rank=0, tp_size=1))
        rope_base._is_cpu = True  # CPU RoPE path (otherwise it asks for vllm's CUDA op)
        try:
            model = LlamaForCausalLMEagle3(hf_config)
            model.load_weights(iter(read_checkpoint_tensors(draft_dir).items()))
        finally:
            rope_base._is_cpu = saved_is_cpu
    return model


# ---------------------------------------------------------------------------- CLI
def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src", help="training checkpoint (.pt), training output dir, or DeepSpec/SGLang draft dir"
    )
    parser.add_argument("out", help="output draft directory (config.json + model.safetensors)")
    parser.add_argument("--target", default=None, help="target model dir, to validate against")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))


def run_export(args: argparse.Namespace) -> int:
    out = export(args.src, args.out, target_dir=args.target, dtype=_DTYPES[args.dtype])
    print(out)
    return 0


def add_make_draft_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", help="target model directory (Hugging Face format)")
    parser.add_argument("out", help="output draft directory")
    parser.add_argument(
        "--kind",
        default="dspark",
        choices=["dspark", "mtp"],
        help="dspark (Qwen3DSparkModel) or mtp (MTP-1 / NextN layer, LlamaForCausalLMEagle3); "
        "mtp ignores the DSpark shape flags",
    )
    parser.add_argument("--block-size", type=int, default=7)
    parser.add_argument("--num-layers", type=int, default=1)
    parser.add_argument("--markov-rank", type=int, default=256)
    parser.add_argument(
        "--markov-head-type", default="vanilla", choices=["vanilla", "gated", "rnn"]
    )
    parser.add_argument("--target-layer-ids", type=_int_list, default=None, help="e.g. 1,8,15")
    parser.add_argument(
        "--num-context-features", type=int, default=None, help="m when ids are not given (5)"
    )
    parser.add_argument("--mask-token-id", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))


def run_make_draft(args: argparse.Namespace) -> int:
    if args.kind == "mtp":
        out = init_random_mtp_draft(
            args.target, args.out, seed=args.seed, dtype=_DTYPES[args.dtype]
        )
        print(out)
        return 0
    out = init_random_draft(
        args.target,
        args.out,
        block_size=args.block_size,
        num_layers=args.num_layers,
        markov_rank=args.markov_rank,
        markov_head_type=args.markov_head_type,
        target_layer_ids=args.target_layer_ids,
        num_context_features=args.num_context_features,
        mask_token_id=args.mask_token_id,
        seed=args.seed,
        dtype=_DTYPES[args.dtype],
    )
    print(out)
    return 0


def _cli(add, run, description: str, argv: Iterable[str] | None) -> int:
    parser = argparse.ArgumentParser(description=description)
    add(parser)
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run(args)
    except (DraftCheckpointError, DraftConfigError) as e:
        parser.exit(2, f"error: {e}\n")


def export_main(argv: Iterable[str] | None = None) -> int:
    return _cli(add_export_arguments, run_export, "Export an SGLang DSpark / MTP draft.", argv)


def make_draft_main(argv: Iterable[str] | None = None) -> int:
    return _cli(
        add_make_draft_arguments,
        run_make_draft,
        "Write a randomly initialised SGLang DSpark draft for a target.",
        argv,
    )


# ---------------------------------------------------------------------------- SGLang check
def sglang_load_check(draft_dir: str | Path, *, ragged_verify_mode: str = "compact"):
    """Build SGLang 0.5.23's own draft model (``srt/models/dspark.py``) on the CPU from
    ``draft_dir``/config.json and run its ``load_weights`` on our safetensors: the same name
    mapping, q/k/v and gate/up fusion and shape checks a server performs, without a server.

    Returns the loaded SGLang module (its forward needs a ForwardBatch and an attention
    backend; tests drive it with a reference attention). ``ragged_verify_mode`` other than
    ``static`` makes SGLang build (and require) the confidence head, as a compact-mode server
    does. Raises whatever SGLang raises.
    """
    import contextlib
    import importlib

    from transformers import AutoConfig

    draft_dir = Path(draft_dir)
    hf_config = AutoConfig.from_pretrained(str(draft_dir))
    rope_base = importlib.import_module("sglang.srt.layers.rotary_embedding.base")
    from sglang.srt.models import dspark as sgl_dspark
    from sglang.srt.runtime_context import get_context

    arch = (getattr(hf_config, "architectures", None) or ["Qwen3DSparkModel"])[0]
    model_cls = {c.__name__: c for c in sgl_dspark.EntryClass}.get(arch)
    if model_cls is None:
        raise DraftCheckpointError(f"SGLang has no DSpark draft class {arch!r}")
    saved_env = os.environ.get("SGLANG_RAGGED_VERIFY_MODE")
    saved_is_cpu = rope_base._is_cpu
    with contextlib.ExitStack() as stack:
        stack.enter_context(get_context().override_server_args(device="cpu"))
        os.environ["SGLANG_RAGGED_VERIFY_MODE"] = ragged_verify_mode
        rope_base._is_cpu = True  # CPU RoPE path (otherwise it asks for vllm's CUDA op)
        try:
            model = model_cls(hf_config)
            tensors = read_checkpoint_tensors(draft_dir)
            model.load_weights(iter(tensors.items()))
        finally:
            rope_base._is_cpu = saved_is_cpu
            if saved_env is None:
                os.environ.pop("SGLANG_RAGGED_VERIFY_MODE", None)
            else:
                os.environ["SGLANG_RAGGED_VERIFY_MODE"] = saved_env
    return model
