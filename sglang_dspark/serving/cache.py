"""Where heavy artefacts live: converted models, generated data, profiles.

Everything the project builds at set-up goes under one cache directory, never into git.
`DSPARK_CACHE_DIR` overrides the default (`~/.cache/sglang-dspark`).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("DSPARK_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "sglang-dspark"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path
