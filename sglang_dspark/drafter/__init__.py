"""The DSpark drafter: model, target adapters, loss, training, checkpoints.

Modules: ``config`` (DSparkDraftConfig <-> SGLang config.json, validation against a target),
``model`` (parallel backbone with KV injection), ``markov_head`` (sequential stage),
``confidence`` (confidence head), ``target`` (HF target adapters, layer-id convention),
``loss`` (CE + TV + CONF), ``train`` (trainer, torchrun-ready), ``checkpoint`` (SGLang
export, DeepSpec import, validation, random init).
"""

from .checkpoint import (
    DraftCheckpointError,
    export,
    import_deepspec,
    init_random_draft,
    load_draft,
    save_draft,
    validate_checkpoint,
)
from .config import DraftConfigError, DSparkDraftConfig, validate_draft_for_target
from .model import DSparkDrafter

__all__ = [
    "DSparkDraftConfig",
    "DSparkDrafter",
    "DraftCheckpointError",
    "DraftConfigError",
    "export",
    "import_deepspec",
    "init_random_draft",
    "load_draft",
    "save_draft",
    "validate_checkpoint",
    "validate_draft_for_target",
]
