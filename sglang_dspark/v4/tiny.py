"""A tiny DeepSeek-V4 checkpoint with a bundled DSpark draft, built once into the cache.

    sglang-dspark setup-tiny-v4 [--out DIR] [--seed N] [--no-draft] [--force]

THE WEIGHTS ARE RANDOM (seeded). The checkpoint exists to exercise SGLang 0.5.23's DeepSeek-V4
code (loader, every layer kind, the bundled-draft path) on small shapes; a target trained
briefly on the project's corpora is a later step, and acceptance rates measured with these
weights mean nothing.

What it holds (``TinyV4Spec`` defaults; about 41.5M target and 10.3M draft parameters, most
of them the 49152 x 256 embedding, LM head and Markov tables):

- 4 decoder layers, one of each attention kind SGLang has: ``compress_ratios`` [0, 4, 128, 4]
  = sliding window only, C4 (compressor with overlap + C4 indexer), C128, C4. MoE on every
  layer (8 routed experts, top-2, 1 shared expert): layers 0-1 hash-routed (``tid2eid``), 2-3
  ``noaux_tc`` / ``sqrtsoftplus`` routing. mHC with ``hc_mult`` 4. Hidden 256, 8 query heads of
  512 (448 nope + 64 rope) on one KV head, q LoRA 128, 2 output groups of rank 128, indexer
  64 heads x 128; window 128, index top-k 512, YaRN (factor 16 over 4096) on the compressed
  layers, plain RoPE on the sliding one.
- SmolLM2's tokenizer (49152 ids, copied from ``sglang-dspark setup-smollm2``), so the
  project's corpora and eval prompts tokenise as for the embedded target.
- A DSpark draft bundled the way SGLang expects one for V4: ``dspark_*`` keys in
  ``config.json`` (SGLang then defaults ``--speculative-draft-model-path`` to the model path
  and loads ``DeepseekV4ForCausalLMDSpark`` from the same files) and tensors under ``mtp.{s}.``:
  3 stages (one per ``dspark_target_layer_ids`` entry), each a sliding-window layer with a
  4-expert MoE and mHC, ``main_proj`` / ``main_norm`` on stage 0, the final norm, mHC head,
  Markov head (rank 32) and confidence head on the last stage.

Names are DeepSeek's own (``embed.weight``, ``layers.{i}.attn.wq_a.weight``,
``layers.{i}.ffn.experts.{e}.w1.weight``, ``mtp.{s}.attn.wkv.weight``, ...): what SGLang's
``remap_weight_name_to_dpsk_hf_format`` and ``_remap_dspark_weight_name`` read, and what
transformers' ``deepseek_v4`` conversion mapping reads too. The tensors are drawn by
transformers' ``DeepseekV4`` initialisation and renamed by ``to_deepseek_names``
(``sglang_dspark.drafter.formats.v4_names``).

Dtypes: bf16, with no ``quantization_config``; float32 where SGLang keeps float32 (mHC
weights, attention sink, compressor ``ape`` and norm, router bias, confidence head) and int32
for ``tid2eid``. DeepSeek's release stores the attention and shared-expert linears as fp8
e4m3 with 128 x 128 UE8M0 scales (``.scale``) and the routed experts as FP4; SGLang's V4
loader takes bf16 linears when no quantization config is set (``wo_a`` passes
``_dequant_fp8_wo_a_streaming`` unchanged, the fp8 ``wo_a`` GEMM is only built with an
``Fp8Config``), and a CPU has no fp8 GEMMs, so bf16 it is.

The build is idempotent and atomic: a finished directory carries ``.dspark-tiny-v4.json``
(request, generator version, sha256 of every file) and is returned as is; the files are
written into a temporary sibling directory that is renamed into place at the end, so a failed
build leaves nothing half-written. A directory whose files no longer match their recorded
hashes is rebuilt; a non-empty directory that is not such a build is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sglang_dspark.drafter.formats.v4_names import (
    storage_dtype,
    to_deepseek_names,
    to_draft_stage_names,
)
from sglang_dspark.serving.cache import cache_dir

logger = logging.getLogger(__name__)

GENERATOR_VERSION = 1
MARKER = ".dspark-tiny-v4.json"
WEIGHTS_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
_LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention",
                128: "heavily_compressed_attention"}  # fmt: skip
_INIT_STD = 0.02


class TinyV4Error(ValueError):
    """The output directory cannot be used; the message says why and what to do."""


@dataclass(frozen=True)
class TinyV4Spec:
    """Shapes of the tiny checkpoint. Head sizes, window, index top-k and indexer head dim are
    the values SGLang's V4 kernels are written for; the rest is as small as still exercises
    every code path."""

    hidden_size: int = 256
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4)
    num_hash_layers: int = 2
    num_attention_heads: int = 8
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 128
    o_groups: int = 2
    o_lora_rank: int = 128
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 256
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    window_size: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    max_position_embeddings: int = 65536
    rope_original_max_position: int = 4096
    rope_factor: float = 16.0
    # The bundled DSpark draft: one stage per target layer id.
    dspark_block_size: int = 5
    dspark_markov_rank: int = 32
    dspark_target_layer_ids: tuple[int, ...] = (1, 2, 3)
    dspark_n_routed_experts: int = 4
    dspark_num_experts_per_tok: int = 2

    def __post_init__(self) -> None:
        n = len(self.compress_ratios)
        bad = [r for r in self.compress_ratios if r not in _LAYER_TYPES]
        if bad:
            raise TinyV4Error(f"compress_ratios {bad} are not V4 layer kinds; use 0, 4 or 128.")
        if not 0 <= self.num_hash_layers <= n:
            raise TinyV4Error(f"num_hash_layers {self.num_hash_layers} is outside 0..{n}.")
        if self.num_attention_heads % self.o_groups:
            raise TinyV4Error(
                f"o_groups {self.o_groups} does not divide {self.num_attention_heads} heads."
            )
        ids = self.dspark_target_layer_ids
        if not ids or any(not 0 <= i < n for i in ids):
            raise TinyV4Error(f"dspark_target_layer_ids {list(ids)} must be ids in 0..{n - 1}.")

    @property
    def num_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def num_stages(self) -> int:
        return len(self.dspark_target_layer_ids)


DEFAULT_SPEC = TinyV4Spec()


def default_dir() -> Path:
    return cache_dir() / "tiny-deepseek-v4"


# ----------------------------------------------------------------------------- config
def config_dict(
    spec: TinyV4Spec, *, vocab_size: int, bos_token_id: int, eos_token_id: int,
    mask_token_id: int, with_draft: bool,
) -> dict:  # fmt: skip
    """``config.json``: DeepSeek-V4's fields (SGLang reads them through its DeepseekV3Config
    alias, transformers through ``DeepseekV4Config``) and, with the draft, the ``dspark_*``
    keys that mark a bundled DSpark head (``checkpoint_bundles_dspark_draft``)."""
    cfg = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "dtype": "bfloat16",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": 1,
        "head_dim": spec.head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "qk_nope_head_dim": spec.head_dim - spec.qk_rope_head_dim,
        "v_head_dim": spec.head_dim,
        "q_lora_rank": spec.q_lora_rank,
        "o_groups": spec.o_groups,
        "o_lora_rank": spec.o_lora_rank,
        "compress_ratios": list(spec.compress_ratios),
        "compress_rope_theta": 160000,
        "window_size": spec.window_size,
        "sliding_window": spec.window_size,
        "index_n_heads": spec.index_n_heads,
        "index_head_dim": spec.index_head_dim,
        "index_topk": spec.index_topk,
        "hc_mult": spec.hc_mult,
        "hc_sinkhorn_iters": spec.hc_sinkhorn_iters,
        "hc_eps": 1e-6,
        "n_routed_experts": spec.n_routed_experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": spec.num_experts_per_tok,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_hash_layers": spec.num_hash_layers,
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sqrtsoftplus",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "rope_theta": 10000,
        # YaRN for the compressed layers; SGLang reads original_max_position_embeddings of
        # every C4/C128 layer from here, sliding layers use plain RoPE at rope_theta.
        "rope_scaling": {
            "type": "yarn",
            "factor": spec.rope_factor,
            "original_max_position_embeddings": spec.rope_original_max_position,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        # No MTP layer is bundled. SGLang's target loader only skips `mtp.*` tensors when
        # this field exists, so it must be present.
        "num_nextn_predict_layers": 0,
        "attention_bias": False,
        "attention_dropout": 0.0,
    }
    if with_draft:
        cfg.update(
            {
                "dspark_block_size": spec.dspark_block_size,
                "dspark_markov_rank": spec.dspark_markov_rank,
                "dspark_markov_head_type": "vanilla",
                "dspark_target_layer_ids": list(spec.dspark_target_layer_ids),
                "dspark_noise_token_id": mask_token_id,
                "dspark_n_routed_experts": spec.dspark_n_routed_experts,
                "dspark_num_experts_per_tok": spec.dspark_num_experts_per_tok,
                "enable_confidence_head": True,
                "confidence_head_with_markov": True,
            }
        )
    return cfg


def _hf_config(
    spec: TinyV4Spec, *, vocab_size: int, compress_ratios, num_hash_layers: int,
    n_routed_experts: int, num_experts_per_tok: int,
):  # fmt: skip
    from transformers import DeepseekV4Config

    n = len(compress_ratios)
    return DeepseekV4Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        moe_intermediate_size=spec.moe_intermediate_size,
        num_hidden_layers=n,
        num_attention_heads=spec.num_attention_heads,
        head_dim=spec.head_dim,
        partial_rotary_factor=spec.qk_rope_head_dim / spec.head_dim,
        q_lora_rank=spec.q_lora_rank,
        o_groups=spec.o_groups,
        o_lora_rank=spec.o_lora_rank,
        n_routed_experts=n_routed_experts,
        num_experts_per_tok=num_experts_per_tok,
        n_shared_experts=1,
        layer_types=[_LAYER_TYPES[r] for r in compress_ratios],
        mlp_layer_types=["hash_moe"] * num_hash_layers + ["moe"] * (n - num_hash_layers),
        index_n_heads=spec.index_n_heads,
        index_head_dim=spec.index_head_dim,
        index_topk=spec.index_topk,
        sliding_window=spec.window_size,
        hc_mult=spec.hc_mult,
        hc_sinkhorn_iters=spec.hc_sinkhorn_iters,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=_INIT_STD,
    )


# ----------------------------------------------------------------------------- tensors
def _seed(seed: int, stream: str) -> int:
    """Independent, reproducible seeds per stream (target, draft, ...) from one user seed."""
    digest = hashlib.sha256(f"tiny-deepseek-v4:{seed}:{stream}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _hash_routing_table(
    vocab_size: int, n_experts: int, top_k: int, gen: torch.Generator
) -> torch.Tensor:
    """tid2eid [V, k]: k distinct experts per token id, drawn uniformly (transformers' init
    leaves zeros, which would send every token to expert 0 k times)."""
    return torch.rand(vocab_size, n_experts, generator=gen).argsort(dim=1)[:, :top_k]


def target_tensors(spec: TinyV4Spec, *, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """The target's tensors under DeepSeek's names, in their storage dtypes."""
    from transformers import DeepseekV4ForCausalLM

    hf_cfg = _hf_config(
        spec, vocab_size=vocab_size, compress_ratios=spec.compress_ratios,
        num_hash_layers=spec.num_hash_layers, n_routed_experts=spec.n_routed_experts,
        num_experts_per_tok=spec.num_experts_per_tok,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(seed, "target"))
        model = DeepseekV4ForCausalLM(hf_cfg)
    tensors = to_deepseek_names(model.state_dict())
    gen = torch.Generator().manual_seed(_seed(seed, "tid2eid"))
    for name in sorted(tensors):
        if name.endswith(".tid2eid"):
            tensors[name] = _hash_routing_table(
                vocab_size, spec.n_routed_experts, spec.num_experts_per_tok, gen
            )
    return {name: t.to(storage_dtype(name)).contiguous() for name, t in sorted(tensors.items())}


def draft_tensors(spec: TinyV4Spec, *, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """The bundled DSpark draft under the names ``_remap_dspark_weight_name`` reads:
    ``mtp.{s}.<decoder layer>`` for each stage (sliding attention, MoE, mHC; transformers'
    init), ``mtp.0.main_proj`` [H, m*H] and ``mtp.0.main_norm``, and on the last stage
    ``norm``, ``hc_head_*``, ``markov_head.{embed,head}`` [V, r] and ``confidence_head.proj``
    [1, H + r]. SGLang ignores the stage index of the Markov and confidence heads."""
    from transformers import DeepseekV4Model

    n, last = spec.num_stages, spec.num_stages - 1
    hf_cfg = _hf_config(
        spec, vocab_size=16, compress_ratios=(0,) * n, num_hash_layers=0,
        n_routed_experts=spec.dspark_n_routed_experts,
        num_experts_per_tok=spec.dspark_num_experts_per_tok,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seed(seed, "draft"))
        stages = DeepseekV4Model(hf_cfg)
    hf = {f"model.{k}": v for k, v in stages.state_dict().items() if not k.startswith("embed")}
    out = to_draft_stage_names(hf, last)
    gen = torch.Generator().manual_seed(_seed(seed, "draft-heads"))
    h, r = spec.hidden_size, spec.dspark_markov_rank

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * _INIT_STD

    out["mtp.0.main_proj.weight"] = normal(h, n * h)
    out["mtp.0.main_norm.weight"] = torch.ones(h)
    out[f"mtp.{last}.markov_head.embed.weight"] = normal(vocab_size, r)
    out[f"mtp.{last}.markov_head.head.weight"] = normal(vocab_size, r)
    out[f"mtp.{last}.confidence_head.proj.weight"] = normal(1, h + r)
    return {name: t.to(storage_dtype(name)).contiguous() for name, t in sorted(out.items())}


def tensor_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- files
def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _request(seed: int, with_draft: bool, spec: TinyV4Spec) -> dict:
    return {
        "generator": GENERATOR_VERSION,
        "seed": int(seed),
        "with_draft": bool(with_draft),
        "spec": json.loads(json.dumps(asdict(spec))),
    }


@dataclass(frozen=True)
class _State:
    # valid | absent | stale (ours, damaged or outdated: rebuild) | other (ours, another
    # seed / spec / draft choice) | foreign (not ours: leave alone)
    kind: str
    reason: str = ""


def _inspect(out: Path, request: dict) -> _State:
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return _State("absent")
    if not out.is_dir():
        return _State("foreign", f"{out} is a file, not a directory")
    marker = out / MARKER
    if not marker.exists():
        return _State("foreign", f"{out} has files but no {MARKER}")
    try:
        record = json.loads(marker.read_text())
        files = dict(record["files"])
        built = {k: record[k] for k in ("generator", "seed", "with_draft", "spec")}
    except (ValueError, KeyError, TypeError) as exc:
        return _State("stale", f"{marker} is unreadable ({exc})")
    if built["generator"] != request["generator"]:
        return _State("stale", f"built by generator version {built['generator']}")
    if built != request:
        differ = [k for k in request if built[k] != request[k]]
        return _State("other", ", ".join(f"{k}={built[k]!r}" for k in differ))
    for name, sha in files.items():
        path = out / name
        if not path.is_file():
            return _State("stale", f"{name} is missing")
        if _file_sha256(path) != sha:
            return _State("stale", f"{name} does not match its recorded sha256")
    return _State("valid")


def check_tiny_v4(path: str | os.PathLike, *, seed: int = 0, with_draft: bool = True,
                  spec: TinyV4Spec = DEFAULT_SPEC) -> str | None:  # fmt: skip
    """None if ``path`` is a complete build for this request, else why not."""
    state = _inspect(Path(path), _request(seed, with_draft, spec))
    return None if state.kind == "valid" else (state.reason or state.kind)


def _tokenizer_info(tokenizer_dir: Path) -> dict:
    cfg = json.loads((tokenizer_dir / "config.json").read_text())
    missing = [f for f in TOKENIZER_FILES[:2] if not (tokenizer_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(
            f"{tokenizer_dir} has no {', '.join(missing)}; rebuild it with "
            "`sglang-dspark setup-smollm2`."
        )
    return {
        "vocab_size": int(cfg["vocab_size"]),
        "bos_token_id": int(cfg["bos_token_id"]),
        "eos_token_id": int(cfg["eos_token_id"]),
        "pad_token_id": cfg.get("pad_token_id"),
    }


def _write(tmp: Path, *, seed: int, with_draft: bool, spec: TinyV4Spec, tokenizer_dir: Path,
           request: dict) -> None:  # fmt: skip
    from safetensors.torch import save_file

    from sglang_dspark.drafter.config import default_mask_token_id

    tok = _tokenizer_info(tokenizer_dir)
    vocab = tok["vocab_size"]
    tensors = target_tensors(spec, vocab_size=vocab, seed=seed)
    counts = {"target_parameters": sum(t.numel() for t in tensors.values())}
    if with_draft:
        draft = draft_tensors(spec, vocab_size=vocab, seed=seed)
        counts["draft_parameters"] = sum(t.numel() for t in draft.values())
        tensors.update(draft)
    config = config_dict(
        spec, vocab_size=vocab, bos_token_id=tok["bos_token_id"],
        eos_token_id=tok["eos_token_id"], mask_token_id=default_mask_token_id(tok),
        with_draft=with_draft,
    )  # fmt: skip
    save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: tok[k] for k in ("bos_token_id", "eos_token_id")}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, tmp / name)
    files = {p.name: _file_sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    record = {
        **request,
        **counts,
        "tensors_sha256": tensor_digest(tensors),
        "weights": "random (seeded); not trained",
        "tokenizer_from": str(tokenizer_dir),
        "files": files,
    }
    (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n")  # last: marks completion
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp made it private
    for path in tmp.iterdir():
        path.chmod(0o666 & ~umask)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_abandoned(out: Path) -> None:
    """Temporary / set-aside siblings left by builds whose process is gone."""
    for path in out.parent.glob(f".{out.name}.*-*"):
        try:
            pid = int(path.name.rsplit(".", 1)[-1].split("-")[1])
        except (IndexError, ValueError):
            continue
        if not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)


def build_tiny_v4(
    out_dir: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    with_draft: bool = True,
    spec: TinyV4Spec = DEFAULT_SPEC,
    tokenizer_dir: str | os.PathLike | None = None,
    force: bool = False,
) -> Path:
    """Build the tiny DeepSeek-V4 checkpoint (random weights, see the module docstring) into
    ``out_dir`` (default ``<cache>/tiny-deepseek-v4``) unless a valid build for the same
    request is there already; return the directory.

    ``with_draft`` bundles the DSpark draft; ``tokenizer_dir`` defaults to the converted
    SmolLM2 directory (``sglang-dspark setup-smollm2``). A build for another seed / spec /
    draft choice is refused unless ``force``; a damaged build is rebuilt."""
    out = Path(out_dir) if out_dir else default_dir()
    request = _request(seed, with_draft, spec)
    state = _inspect(out, request)
    if state.kind == "valid":
        return out
    if state.kind == "foreign":
        raise TinyV4Error(
            f"{state.reason}: it is not a tiny DeepSeek-V4 build, so it is left alone. "
            "Move it away or pass another --out."
        )
    if state.kind == "other" and not force:
        raise TinyV4Error(
            f"{out} holds a tiny DeepSeek-V4 build with {state.reason}, not the one asked for "
            f"(seed={seed}, with_draft={with_draft}). Pass --force to rebuild it, or another --out."
        )
    if state.kind in ("stale", "other"):
        logger.warning("Rebuilding %s: %s", out, state.reason)
    if tokenizer_dir is None:
        from sglang_dspark.serving.smollm2 import ensure_smollm2

        tokenizer_dir = ensure_smollm2()
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-{os.getpid()}-", dir=out.parent))
    try:
        logger.info("Building a tiny DeepSeek-V4 checkpoint (random weights, seed %d) in %s",
                    seed, out)  # fmt: skip
        _write(tmp, seed=seed, with_draft=with_draft, spec=spec,
               tokenizer_dir=Path(tokenizer_dir), request=request)  # fmt: skip
        _install(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if _inspect(out, request).kind != "valid":  # a concurrent build of another request won
        raise TinyV4Error(f"{out} changed while building; run the command again.")
    return out


def _install(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` into place; an old ``out`` is set aside first and removed
    after, so ``out`` is never a mixture of two builds."""
    aside = None
    if out.exists():
        aside = out.with_name(f".{out.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
        os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except OSError:
        if not out.exists():
            raise
        # Another process installed its build first; keep that one.
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
