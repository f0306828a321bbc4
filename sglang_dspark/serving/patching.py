"""Patches against sglang==0.5.23 for what a plugin hook cannot reach.

Each file in `patches/` is a unified diff rooted at site-packages (`a/sglang/...`). A patch is
needed only where the plugin cannot act in time, e.g. a module-level import that fails before
`load_plugins()` runs. `check` reports each patch as applied / not applied / does not apply;
`apply` is idempotent. GNU patch does the work.
"""

from __future__ import annotations

import enum
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from sglang_dspark import SGLANG_VERSION


class PatchState(enum.Enum):
    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    CONFLICT = "does not apply"


@dataclass(frozen=True)
class PatchStatus:
    name: str
    state: PatchState


def patches_dir() -> Path:
    here = Path(__file__).resolve().parents[1] / "patches"
    if not here.is_dir():
        raise FileNotFoundError(f"patch directory {here} is missing; reinstall sglang-dspark")
    return here


def patch_files() -> list[Path]:
    return sorted(patches_dir().glob("*.patch"))


def sglang_root() -> Path:
    """The directory that holds the installed `sglang` package (site-packages)."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise RuntimeError("sglang is not installed; `pip install sglang==0.5.23` first")
    return Path(spec.origin).resolve().parent.parent


def check_sglang_version() -> None:
    found = metadata.version("sglang")
    if found != SGLANG_VERSION:
        raise RuntimeError(
            f"sglang-dspark patches target sglang=={SGLANG_VERSION}, but sglang=={found} is "
            f"installed; run `pip install sglang=={SGLANG_VERSION}`"
        )


def _patch(args: list[str], patch: Path, root: Path) -> bool:
    exe = shutil.which("patch")
    if exe is None:
        raise RuntimeError("GNU patch is required: `apt-get install patch`")
    proc = subprocess.run(
        [exe, "-p1", "-d", str(root), "-i", str(patch), "--force", "--silent", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.returncode == 0


def status(root: Path | None = None) -> list[PatchStatus]:
    root = root or sglang_root()
    out = []
    for patch in patch_files():
        if _patch(["--dry-run", "--reverse"], patch, root):
            state = PatchState.APPLIED
        elif _patch(["--dry-run"], patch, root):
            state = PatchState.NOT_APPLIED
        else:
            state = PatchState.CONFLICT
        out.append(PatchStatus(patch.name, state))
    return out


def apply(root: Path | None = None) -> list[PatchStatus]:
    """Apply every patch that is not applied yet. Refuses (changes nothing) on a conflict."""
    root = root or sglang_root()
    before = status(root)
    conflicts = [s.name for s in before if s.state is PatchState.CONFLICT]
    if conflicts:
        raise RuntimeError(
            f"patches {conflicts} do not apply to the sglang at {root}: it is not a clean "
            f"sglang=={SGLANG_VERSION}. Reinstall it (`pip install --force-reinstall --no-deps "
            f"sglang=={SGLANG_VERSION}`) and run `sglang-dspark patches apply` again"
        )
    for s in before:
        if s.state is PatchState.NOT_APPLIED and not _patch(
            ["--no-backup-if-mismatch"], patches_dir() / s.name, root
        ):
            raise RuntimeError(f"applying {s.name} failed after a clean dry run")
    return status(root)


def revert(root: Path | None = None) -> list[PatchStatus]:
    """Undo applied patches (used by tests that need an unmodified sglang)."""
    root = root or sglang_root()
    for s in reversed(status(root)):
        if s.state is PatchState.APPLIED:
            _patch(["--reverse", "--no-backup-if-mismatch"], patches_dir() / s.name, root)
    return status(root)
