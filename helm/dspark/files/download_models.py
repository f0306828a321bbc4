"""Download the target and draft models from Hugging Face into the model volume, or wait for them.

Input: env DSPARK_MODELS, a JSON list of {"role", "repo", "revision", "dir"}. A token, if any,
comes from env HF_TOKEN (read by huggingface_hub itself; never printed here).

    download_models.py          download every model not yet complete in its directory
    download_models.py --wait   only wait (env DSPARK_WAIT_TIMEOUT_SECONDS) until another
                                process (the prefetch Job) has completed every model

The revision (a branch, tag or commit; empty: main) is resolved to its commit first and that
commit is downloaded, so a moving branch cannot mix two commits in one directory; the marker
file written last records repo, requested revision and commit, and the log says how to pin
the commit. A directory whose marker matches the repo and requested revision is complete and
skipped, so a persistent volume is filled once and reused. Downloads into one directory are
serialised with a file lock beside it: replicas that share a volume and start together
download once, the others wait and then find the marker.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sys
import time
from pathlib import Path

MARKER = ".dspark-download-complete"
LOCK = ".dspark-download.lock"

logging.basicConfig(level=logging.INFO, format="download-models: %(message)s", stream=sys.stdout)
log = logging.getLogger("download-models")


def requested(model: dict) -> str:
    return model["revision"] or "main"


def complete(model: dict) -> dict | None:
    """The marker of a complete download of this repo and requested revision, else None."""
    marker = Path(model["dir"]) / MARKER
    try:
        text = marker.read_text().strip()
    except OSError:
        return None
    try:
        record = json.loads(text)
    except ValueError:  # the older one-line marker: "<repo>@<revision>"
        record = {"repo": text.rsplit("@", 1)[0], "revision": text.rsplit("@", 1)[-1]}
    if record.get("repo") == model["repo"] and record.get("revision") == requested(model):
        return record
    return None


def download(model: dict) -> None:
    from huggingface_hub import HfApi, snapshot_download

    target = Path(model["dir"])
    target.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}{LOCK}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another replica may be downloading the same model
        if (record := complete(model)) is not None:
            log.info(
                "%s: %s@%s already complete (commit %s)",
                model["role"],
                model["repo"],
                record["revision"],
                record.get("commit", "?"),
            )
            return
        commit = HfApi().model_info(model["repo"], revision=requested(model)).sha
        log.info(
            "%s: downloading %s@%s (commit %s) into %s",
            model["role"],
            model["repo"],
            requested(model),
            commit,
            target,
        )
        snapshot_download(repo_id=model["repo"], revision=commit, local_dir=str(target))
        record = {"repo": model["repo"], "revision": requested(model), "commit": commit}
        (target / MARKER).write_text(json.dumps(record) + "\n")
        if requested(model) != commit:
            log.info(
                "%s: done; pin it with models.%s.revision=%s", model["role"], model["role"], commit
            )
        else:
            log.info("%s: done", model["role"])


def wait(models: list[dict], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [m for m in models if complete(m) is None]
        if not missing:
            for m in models:
                log.info(
                    "%s: %s complete (commit %s)",
                    m["role"],
                    m["repo"],
                    complete(m).get("commit", "?"),
                )
            return 0
        if time.monotonic() > deadline:
            log.error(
                "still incomplete after %.0f s: %s; is the prefetch Job running? "
                "kubectl get jobs -l app.kubernetes.io/component=models",
                timeout_s,
                ", ".join(f"{m['repo']}@{requested(m)}" for m in missing),
            )
            return 1
        log.info(
            "waiting for the prefetch Job: %s",
            ", ".join(f"{m['repo']}@{requested(m)}" for m in missing),
        )
        time.sleep(30)


def main(argv: list[str]) -> int:
    models = json.loads(os.environ["DSPARK_MODELS"])
    if not models:
        log.info("nothing to download")
        return 0
    if argv[1:] == ["--wait"]:
        return wait(models, float(os.environ.get("DSPARK_WAIT_TIMEOUT_SECONDS", "21600")))
    for model in models:
        download(model)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
