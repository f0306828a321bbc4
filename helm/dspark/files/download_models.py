"""Download the target and draft models from Hugging Face into the model volume.

Input: env DSPARK_MODELS, a JSON list of {"role", "repo", "revision", "dir"}. A token, if any,
comes from env HF_TOKEN (read by huggingface_hub itself; never printed here). A directory that
already holds a complete snapshot of the same repo and revision is skipped, so a persistent
volume is filled once and reused.
"""

import json
import logging
import os
import sys
from pathlib import Path

from huggingface_hub import snapshot_download

MARKER = ".dspark-download-complete"

logging.basicConfig(level=logging.INFO, format="download-models: %(message)s", stream=sys.stdout)
log = logging.getLogger("download-models")


def main() -> int:
    models = json.loads(os.environ["DSPARK_MODELS"])
    if not models:
        log.info("nothing to download")
        return 0
    for model in models:
        repo, revision, target = model["repo"], model["revision"] or None, Path(model["dir"])
        stamp = f"{repo}@{revision or 'main'}"
        marker = target / MARKER
        if marker.is_file() and marker.read_text().strip() == stamp:
            log.info("%s: %s already complete in %s", model["role"], stamp, target)
            continue
        log.info("%s: downloading %s into %s", model["role"], stamp, target)
        target.mkdir(parents=True, exist_ok=True)
        snapshot_download(repo_id=repo, revision=revision, local_dir=str(target))
        marker.write_text(stamp + "\n")
        log.info("%s: done", model["role"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
