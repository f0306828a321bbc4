"""The DSpark drafter: the model here, its training in ``training/``, its files in ``formats/``.

Modules: ``config`` (DSparkDraftConfig <-> SGLang config.json, validation against a target),
``model`` (parallel backbone with KV injection), ``markov_head`` (sequential stage),
``confidence`` (confidence head), ``mtp`` (the MTP-1 baseline drafter), ``dspark_v4``
(the DeepSeek-V4 drafter); ``training/`` (trainers, data, losses, target adapters),
``formats/`` (SGLang export, DeepSpec import, validation, random init, draft vocabulary).
"""

from sglang_dspark.drafter.config import (
    DraftConfigError,
    DSparkDraftConfig,
    validate_draft_for_target,
)
from sglang_dspark.drafter.formats.checkpoint import (
    DraftCheckpointError,
    export,
    import_deepspec,
    init_random_draft,
    load_draft,
    save_draft,
    validate_checkpoint,
)
from sglang_dspark.drafter.model import DSparkDrafter

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
