"""`dspark_draft_validation`: refuse a draft that does not fit the target, at start-up.

Upstream 0.5.23 reads the draft config during argument resolution but only for gamma, and
swallows errors; a draft whose target_layer_ids the target cannot capture, whose mask token is
outside the vocabulary, whose hidden size or vocabulary differs from the target's, or whose
gamma differs from `--speculative-dspark-block-size` starts fine and dies at the first request.
After `_handle_dspark` resolves the speculative arguments we check the pair with
`sglang_dspark.drafter.config.validate_draft_for_target` and stop the launch with every
problem and its fix.
"""

from __future__ import annotations

import json
import logging

from sglang_dspark.plugin.registry import register_after

logger = logging.getLogger(__name__)


class DraftMismatchError(ValueError):
    """The DSPARK draft cannot serve this target; the message lists why and what to do."""


def load_config(path: str, revision: str | None, trust_remote_code: bool) -> dict:
    """A checkpoint's config.json as a dict: read directly when local, else SGLang's get_config."""
    from pathlib import Path

    local = Path(path) / "config.json"
    if local.is_file():
        return json.loads(local.read_text())
    from sglang.srt.utils.hf_transformers_utils import get_config

    return get_config(path, trust_remote_code=trust_remote_code, revision=revision).to_dict()


def check_draft(result, server_args) -> None:
    from sglang.srt.arg_groups.overrides import resolving_view

    from sglang_dspark.drafter.config import DraftConfigError, validate_draft_for_target

    cfg = resolving_view(server_args)
    draft_path = cfg.speculative_draft_model_path
    if draft_path is None or draft_path == cfg.model_path:
        return  # a draft bundled in the target checkpoint (DeepSeek-V4): v4_validation
    trust = bool(cfg.trust_remote_code)
    draft = load_config(draft_path, cfg.speculative_draft_model_revision, trust)
    if draft.get("architectures", [None])[0] not in {
        "Qwen3DSparkModel",
        "DSparkDraftModel",
        "LingDSparkModel",
    }:
        return  # other draft families have their own loaders; nothing of ours to check
    target = load_config(cfg.model_path, cfg.revision, trust)
    try:
        problems = validate_draft_for_target(
            draft, target, block_size=cfg.speculative_dspark_block_size
        )
    except DraftConfigError as exc:
        problems = [str(exc)]
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise DraftMismatchError(
            f"DSPARK draft {draft_path} does not fit target {cfg.model_path}:\n{lines}"
        )
    logger.info("sglang-dspark: draft %s fits target %s", draft_path, cfg.model_path)


def install() -> None:
    register_after("sglang.srt.arg_groups.speculative_hook._handle_dspark", check_draft)


HOOKS = {"dspark_draft_validation": install}
