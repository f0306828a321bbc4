"""DSpark draft configuration and its SGLang ``config.json`` form.

One dataclass, :class:`DSparkDraftConfig`, describes a drafter: the Qwen3-shaped backbone
(hidden size, heads, layers, RoPE) plus the DSpark fields SGLang's loader reads
(``srt/speculative/dspark_components/dspark_config.py``, ``srt/models/dspark.py``):

    block_size (gamma), markov_rank (r), markov_head_type, mask_token_id,
    target_layer_ids (l_1..l_m, HF layer-output ids), num_target_layers,
    enable_confidence_head, confidence_head_with_markov, sample_from_anchor.

:func:`validate_draft_for_target` lists everything that would make SGLang 0.5.23 refuse the
drafter or, worse, accept it and fail at the first request.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# The architecture tag SGLang's registry maps to `srt/models/dspark.py:Qwen3DSparkModel`.
SGLANG_ARCHITECTURE = "Qwen3DSparkModel"
ACCEPTED_ARCHITECTURES = ("Qwen3DSparkModel", "DSparkDraftModel", "LingDSparkModel")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
DEFAULT_NUM_CONTEXT_FEATURES = 5  # m: DeepSpec uses 5 target layers (e.g. [1, 9, 17, 25, 33])


class DraftConfigError(ValueError):
    """A draft configuration SGLang would refuse or mis-serve; the message says what to do."""


@dataclass
class DSparkDraftConfig:
    """A DSpark drafter: Qwen3-style parallel backbone + sequential head + confidence head."""

    # Backbone (the usual Qwen3 fields). hidden_size must equal the target's: the drafter
    # shares the target's token embedding and LM head.
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    target_layer_ids: list[int]  # l_1..l_m: HF layer-output ids, SGLang captures at id + 1
    num_target_layers: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    hidden_act: str = "silu"
    # DSpark.
    block_size: int = 7  # gamma
    markov_rank: int = 256  # r
    markov_head_type: str = "vanilla"
    mask_token_id: int = 0
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    sample_from_anchor: bool = True
    # Anything else found in a loaded config.json, kept so a round trip loses nothing.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_context_features(self) -> int:
        """m, the number of target layers whose hidden states are concatenated."""
        return len(self.target_layer_ids)

    # ------------------------------------------------------------------ construction
    @classmethod
    def for_target(
        cls,
        target_config: Any,
        *,
        num_layers: int = 1,
        block_size: int = 7,
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        target_layer_ids: Sequence[int] | None = None,
        num_context_features: int | None = None,
        mask_token_id: int | None = None,
        intermediate_size: int | None = None,
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
    ) -> DSparkDraftConfig:
        """A drafter shaped for ``target_config`` (HF config object or config.json dict).

        Heads, head_dim, RoPE base and norm epsilon follow the target; ``target_layer_ids``
        defaults to :func:`default_target_layer_ids` with m = ``num_context_features``
        (default 5, as in every DeepSpec config, whatever the draft depth); ``mask_token_id`` to
        :func:`default_mask_token_id`.
        """
        t = _as_dict(target_config)
        num_target_layers = int(t["num_hidden_layers"])
        hidden = int(t["hidden_size"])
        heads = int(t["num_attention_heads"])
        vocab = int(t["vocab_size"])
        if target_layer_ids is None:
            m = num_context_features or min(DEFAULT_NUM_CONTEXT_FEATURES, num_target_layers - 1)
            target_layer_ids = default_target_layer_ids(num_target_layers, m)
        if mask_token_id is None:
            mask_token_id = default_mask_token_id(t)
        rope_scaling = t.get("rope_scaling")
        rope_theta = t.get("rope_theta")
        if rope_theta is None and isinstance(t.get("rope_parameters"), Mapping):
            rope_theta = t["rope_parameters"].get("rope_theta")
        if rope_scaling not in (None, {}) and not _is_default_rope(rope_scaling):
            logger.warning(
                "target uses rope_scaling=%s; the drafter uses plain RoPE (theta=%s), as its "
                "positions never exceed max_position_embeddings",
                rope_scaling,
                rope_theta,
            )
        return cls(
            hidden_size=hidden,
            intermediate_size=int(intermediate_size or t.get("intermediate_size") or 4 * hidden),
            num_hidden_layers=int(num_layers),
            num_attention_heads=heads,
            num_key_value_heads=int(t.get("num_key_value_heads") or heads),
            head_dim=int(t.get("head_dim") or hidden // heads),
            vocab_size=vocab,
            target_layer_ids=[int(x) for x in target_layer_ids],
            num_target_layers=num_target_layers,
            rms_norm_eps=float(t.get("rms_norm_eps") or 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=int(t.get("max_position_embeddings") or 32768),
            block_size=int(block_size),
            markov_rank=int(markov_rank),
            markov_head_type=str(markov_head_type),
            mask_token_id=int(mask_token_id),
            enable_confidence_head=bool(enable_confidence_head),
            confidence_head_with_markov=bool(confidence_head_with_markov),
        )

    # ------------------------------------------------------------------ config.json
    def to_sglang_dict(self) -> dict[str, Any]:
        """The config.json SGLang 0.5.23 loads (model_type qwen3, Qwen3DSparkModel)."""
        out: dict[str, Any] = dict(self.extra)
        out.update(
            architectures=[SGLANG_ARCHITECTURE],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=None,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act=self.hidden_act,
            attention_bias=False,
            tie_word_embeddings=False,
            layer_types=["full_attention"] * self.num_hidden_layers,
            torch_dtype="bfloat16",
            block_size=self.block_size,
            markov_rank=self.markov_rank,
            markov_head_type=self.markov_head_type,
            mask_token_id=self.mask_token_id,
            target_layer_ids=list(self.target_layer_ids),
            num_target_layers=self.num_target_layers,
            enable_confidence_head=self.enable_confidence_head,
            confidence_head_with_markov=self.confidence_head_with_markov,
            sample_from_anchor=self.sample_from_anchor,
        )
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> DSparkDraftConfig:
        """Parse an SGLang- or DeepSpec-format config.json (same key lookup order as SGLang:
        ``dspark_*`` prefixed keys, nested ``dspark_config`` / ``dflash_config``,
        ``text_config``, top level)."""
        top = dict(raw)
        text = dict(top.get("text_config") or {})
        nested = {**dict(top.get("dflash_config") or {}), **dict(top.get("dspark_config") or {})}

        def get(key: str, default: Any = None, prefixed: str | None = None) -> Any:
            if prefixed and top.get(prefixed) is not None:
                return top[prefixed]
            for src in (nested, text, top):
                if src.get(key) is not None:
                    return src[key]
            return default

        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if get(k) is None
        ]
        if missing:
            raise DraftConfigError(
                f"draft config.json lacks {missing}; it does not describe a Qwen3-shaped DSpark "
                "drafter. Re-export it with `sglang-dspark export`."
            )
        layer_ids = get("target_layer_ids", prefixed="dspark_target_layer_ids")
        if layer_ids is None:
            raise DraftConfigError(
                "draft config.json has no target_layer_ids; set it to the HF layer-output ids "
                "of the target layers the drafter was trained on (e.g. [1, 8, 15, 22, 27])."
            )
        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        rope_theta = get("rope_theta")
        if rope_theta is None and isinstance(get("rope_parameters"), Mapping):
            rope_theta = get("rope_parameters").get("rope_theta")
        num_hidden_layers = int(get("num_hidden_layers"))
        conf_with_markov = get("confidence_head_with_markov")
        markov_rank = int(get("markov_rank", 0, prefixed="dspark_markov_rank") or 0)
        cfg = cls(
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size", 4 * hidden)),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim") or hidden // heads),
            vocab_size=int(get("vocab_size")),
            target_layer_ids=[int(x) for x in layer_ids],
            num_target_layers=int(get("num_target_layers") or max(int(x) for x in layer_ids) + 2),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            hidden_act=str(get("hidden_act", "silu")),
            block_size=int(get("block_size", 7, prefixed="dspark_block_size")),
            markov_rank=markov_rank,
            markov_head_type=str(
                get("markov_head_type", "vanilla", prefixed="dspark_markov_head_type")
            ).lower(),
            mask_token_id=int(get("mask_token_id", 0, prefixed="dspark_noise_token_id")),
            # SGLang 0.5.23 only checks that the key exists (a `false` is ignored), so a
            # missing key means "enabled" there too.
            enable_confidence_head=bool(get("enable_confidence_head", True)),
            confidence_head_with_markov=bool(
                markov_rank > 0 if conf_with_markov is None else conf_with_markov
            ),
            sample_from_anchor=bool(get("sample_from_anchor", True)),
        )
        cfg.extra = {
            k: v
            for k, v in top.items()
            if k not in known
            and k not in _SGLANG_WRITTEN_KEYS
            and k not in _TRAINING_ONLY_KEYS
            and not k.startswith("_")
        }
        return cfg

    @classmethod
    def load(cls, draft_dir: str | Path) -> DSparkDraftConfig:
        path = Path(draft_dir) / "config.json"
        if not path.is_file():
            raise DraftConfigError(
                f"{path} does not exist; a draft directory holds config.json and "
                "model.safetensors (write one with `sglang-dspark export` or `make-draft`)."
            )
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DraftConfigError(f"{path} is not valid JSON ({e}); re-export the draft.") from e
        return cls.from_dict(raw)

    def save(self, draft_dir: str | Path) -> Path:
        path = Path(draft_dir) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_sglang_dict(), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        return path

    # ------------------------------------------------------------------ self-consistency
    def problems(self, *, check_layer_ids: bool = True) -> list[str]:
        """Problems that need no target to find (each one SGLang would trip on). Layer ids
        are checked against ``num_target_layers`` unless ``check_layer_ids`` is false."""
        out: list[str] = []
        if check_layer_ids:
            out += layer_id_problems(self.target_layer_ids, self.num_target_layers)
        if self.markov_rank <= 0:
            out.append(
                f"markov_rank is {self.markov_rank}; SGLang's DSPARK requires a Markov head "
                "(markov_rank > 0, e.g. 256)."
            )
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            out.append(
                f"markov_head_type {self.markov_head_type!r} is not one of {MARKOV_HEAD_TYPES}."
            )
        if self.block_size < 1:
            out.append(f"block_size (gamma) is {self.block_size}; it must be >= 1.")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            out.append(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}."
            )
        if self.mask_token_id < 0 or self.mask_token_id >= self.vocab_size:
            out.append(
                f"mask_token_id {self.mask_token_id} is outside the draft vocabulary "
                f"({self.vocab_size}); set it below {self.vocab_size}."
            )
        if self.confidence_head_with_markov and self.markov_rank <= 0:
            out.append("confidence_head_with_markov needs markov_rank > 0.")
        if self.hidden_act != "silu":
            out.append(f"hidden_act {self.hidden_act!r}: SGLang's DSpark draft MLP runs silu.")
        if not self.sample_from_anchor:
            out.append(
                "sample_from_anchor is false (DFlash layout: anchor + gamma masks); this "
                "drafter implements DSpark's [anchor, mask x (gamma-1)] layout only."
            )
        return out

    def check(self) -> None:
        """Raise :class:`DraftConfigError` listing :meth:`problems`, if any."""
        found = self.problems()
        if found:
            raise DraftConfigError("invalid DSpark draft config:\n  - " + "\n  - ".join(found))


# Keys to_sglang_dict writes itself; they are not "extra".
_SGLANG_WRITTEN_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "rope_scaling",
        "attention_bias",
        "tie_word_embeddings",
        "layer_types",
        "torch_dtype",
        "dtype",
        "text_config",
        "dspark_config",
        "dflash_config",
        "dspark_block_size",
        "dspark_markov_rank",
        "dspark_markov_head_type",
        "dspark_noise_token_id",
        "dspark_target_layer_ids",
        "rope_parameters",
        "transformers_version",
    }
)
# DeepSpec writes training knobs into the draft config; SGLang ignores them.
_TRAINING_ONLY_KEYS = frozenset({"num_anchors", "auto_map", "use_cache", "attention_dropout"})


def default_mask_token_id(target_config: Any) -> int:
    """A token id to embed at the gamma-1 mask positions of a block.

    The embedding is the target's (frozen), so the id should be one the target never sees in
    text: a padding row past the tokenizer's vocabulary (``padded_vocab_size``), else a
    dedicated pad token, else the last vocabulary id (a rare BPE merge). Never the EOS/BOS
    token. Any fixed id works once the drafter is trained with it; it must stay the same.
    """
    t = _as_dict(target_config)
    vocab = int(t["vocab_size"])
    padded = int(t.get("padded_vocab_size") or vocab)
    if padded > vocab:
        return vocab
    special = set()
    for key in ("eos_token_id", "bos_token_id"):
        v = t.get(key)
        special.update(v if isinstance(v, list) else [v])
    pad = t.get("pad_token_id")
    if isinstance(pad, int) and 0 <= pad < vocab and pad not in special:
        return pad
    return vocab - 1


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """m evenly spread HF layer-output ids in [1, L - 3], as SGLang/DFlash pick them.

    With L = 30 and m = 5 this gives [1, 8, 14, 20, 27]. ``num_features`` is m; DeepSpec
    ties it to the draft depth but any m works. Never returns L - 1 (see
    :func:`layer_id_problems`).
    """
    L, m = int(num_target_layers), int(num_features)
    if L < 2:
        raise DraftConfigError(f"a target with {L} layer(s) has no capturable layer output.")
    if m == 1:
        return [min(L // 2, L - 2)]
    start, end = 1, max(L - 3, 1)
    if end - start + 1 < m:
        start, end = 0, L - 2
    if end - start + 1 < m:
        raise DraftConfigError(
            f"cannot pick {m} distinct capturable layers from a {L}-layer target "
            f"(ids 0..{L - 2}); use at most {L - 1} features."
        )
    span = end - start
    return sorted({round(start + i * span / (m - 1)) for i in range(m)})


def layer_id_problems(target_layer_ids: Sequence[int], num_target_layers: int) -> list[str]:
    """Why SGLang would not capture exactly these target layers, one message each.

    SGLang 0.5.23 captures the hidden state of HF layer id ``l`` as the residual stream
    entering layer ``l + 1`` (``set_dflash_layers_to_capture``: ``layers_to_capture =
    [l + 1 for l in ids]``), in layer order. Hence:
    - ``l = L - 1`` (the last layer) is accepted by the config check (``l < L``) but never
      captured: there is no layer L. The draft then receives m - 1 features and the server
      dies at the first request with "target_hidden feature dim mismatch". Valid: 0..L-2.
    - ``l < 0`` (DeepSpec's -1 = embedding output) is refused by SGLang.
    - Unsorted or repeated ids are captured in layer order / once, so the feature order or
      count would silently differ from training.
    """
    ids = [int(x) for x in target_layer_ids]
    L = int(num_target_layers)
    out: list[str] = []
    if not ids:
        return ["target_layer_ids is empty; list at least one target layer."]
    for l in ids:
        if l < 0:
            out.append(
                f"target_layer_id {l} is negative; SGLang refuses it (DeepSpec's -1 = embedding "
                "output has no SGLang equivalent). Use ids in 0..{}.".format(L - 2)
            )
        elif l == L - 1:
            out.append(
                f"target_layer_id {l} is the last layer of this {L}-layer target: SGLang captures "
                f"layer l's output at the input of layer l + 1 = {L}, which does not exist, so "
                f"only {len(ids) - 1} of {len(ids)} features would be captured and the server "
                f"would fail at the first request. Use ids in 0..{L - 2} (e.g. {L - 3})."
            )
        elif l >= L:
            out.append(
                f"target_layer_id {l} is out of range for a {L}-layer target; use ids in "
                f"0..{L - 2}."
            )
    if any(b <= a for a, b in itertools.pairwise(ids)):
        out.append(
            f"target_layer_ids {ids} must be strictly increasing: SGLang captures features in "
            "layer order and only once per layer."
        )
    return out


def validate_draft_for_target(
    draft_config: DSparkDraftConfig | Mapping[str, Any] | Any,
    target_config: Any,
    *,
    block_size: int | None = None,
) -> list[str]:
    """Every reason this draft would not serve correctly with this target on SGLang 0.5.23.

    ``draft_config``: a :class:`DSparkDraftConfig`, a config.json dict or an HF config.
    ``target_config``: the target's HF config object or config.json dict.
    ``block_size``: the gamma the server was asked for (``--speculative-dspark-block-size``),
    if any. Returns an empty list when all is well.
    """
    draft = (
        draft_config
        if isinstance(draft_config, DSparkDraftConfig)
        else (DSparkDraftConfig.from_dict(_as_dict(draft_config)))
    )
    t = _as_dict(target_config)
    out = draft.problems(check_layer_ids=False)
    L = int(t.get("num_hidden_layers") or 0)
    t_hidden = int(t.get("hidden_size") or 0)
    t_vocab = int(t.get("vocab_size") or 0)
    # The mask token is only embedded, so its bound is the embedding row count
    # (padded_vocab_size when the target pads its table), as in dspark_worker_v2.py.
    embed_rows = int(t.get("padded_vocab_size") or t_vocab)
    out += layer_id_problems(draft.target_layer_ids, L)
    if draft.num_target_layers != L:
        out.append(
            f"num_target_layers is {draft.num_target_layers} but the target has {L} layers; "
            "the drafter was trained on a different target. Train or export it for this one."
        )
    if draft.hidden_size != t_hidden:
        out.append(
            f"draft hidden_size {draft.hidden_size} differs from the target's {t_hidden}; the "
            "drafter shares the target's embedding and LM head, so they must be equal."
        )
    if draft.vocab_size != t_vocab:
        out.append(
            f"draft vocab_size {draft.vocab_size} differs from the target vocabulary ({t_vocab}); "
            "the Markov head must cover exactly the target's vocabulary. Use a drafter trained "
            "for this target."
        )
    if not 0 <= draft.mask_token_id < embed_rows:
        # one message for one fault: the target's bound supersedes the draft's own
        out = [m for m in out if not m.startswith(f"mask_token_id {draft.mask_token_id} ")]
        out.append(
            f"mask_token_id {draft.mask_token_id} is outside the target vocabulary ({embed_rows}); "
            f"set it below {embed_rows}."
        )
    if block_size is not None and int(block_size) != draft.block_size:
        out.append(
            f"requested block size (gamma) {block_size} differs from the draft's block_size "
            f"{draft.block_size}; the drafter was trained for gamma={draft.block_size}. Drop the "
            "override or use a drafter trained for the requested gamma."
        )
    t_max_pos = t.get("max_position_embeddings")
    if t_max_pos and draft.max_position_embeddings < int(t_max_pos):
        out.append(
            f"draft max_position_embeddings {draft.max_position_embeddings} is below the "
            f"target's {t_max_pos}; SGLang's RoPE cache would be too short for long contexts."
        )
    return out


def _is_default_rope(rope: Any) -> bool:
    return isinstance(rope, Mapping) and rope.get("rope_type", rope.get("type")) in (
        None,
        "default",
    )


def _as_dict(config: Any) -> dict[str, Any]:
    """A flat dict of an HF config object / dict (text_config of multimodal configs)."""
    if config is None:
        return {}
    if isinstance(config, DSparkDraftConfig):
        return config.to_sglang_dict()
    if isinstance(config, Mapping):
        d = dict(config)
    elif hasattr(config, "to_dict"):
        d = config.to_dict()
    else:
        d = dict(vars(config))
    text = d.get("text_config")
    if isinstance(text, Mapping) and "num_hidden_layers" in text:
        d = {**d, **dict(text)}
    return d
