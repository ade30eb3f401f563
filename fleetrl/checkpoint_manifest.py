"""A trainer checkpoint's files as a resume can trust them, without torch (`fleetrl up --resume` checks them before
any service starts; the trainer before it loads one).

A checkpoint `<checkpoint_dir>/step-<version>` is whole when its `manifest.json` (written last, by
`write_manifest`) is there and every file it lists is there with its size and SHA-256 (`verify_checkpoint`).
`<checkpoint_dir>/latest` names the newest; `resume_checkpoint` takes it if whole, else the newest whole one
before it, saying which it passed over and why; with none whole it raises `CheckpointDamaged` naming the damaged
file. Writing them is fleetrl.trainer.checkpoint's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

LATEST = "latest"
STATE_FILE = "trainer_state.json"
MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"  # DCP's index of the shards: without it nothing loads
PARTIAL = ".partial"  # a checkpoint being written: never loaded
_STEP_NAME = re.compile(r"^step-(\d{8})$")


class CheckpointDamaged(RuntimeError):
    """No whole checkpoint to resume from; the message names the damaged file (one line)."""


def checkpoint_path(root: str | Path, version: int) -> Path:
    return Path(root) / f"step-{version:08d}"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def _sha256(path: Path, fsync: bool = False) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        if fsync:  # on disk before the rename that makes the checkpoint whole
            os.fsync(f.fileno())
    return digest.hexdigest()


def write_manifest(path: str | Path) -> Path:
    """Write `<path>/manifest.json`: the size and SHA-256 of every file of the checkpoint (and sync them to
    disk). The last file of a checkpoint: a folder without one is not whole."""
    path = Path(path)
    files = {
        str(f.relative_to(path)): {"size": f.stat().st_size, "sha256": _sha256(f, fsync=True)} for f in _files(path)
    }
    manifest = path / MANIFEST
    write_atomic(manifest, json.dumps({"files": files}, indent=1))
    return manifest


def verify_checkpoint(path: str | Path) -> str | None:
    """Why the checkpoint at `path` cannot be trusted (one phrase naming the damaged file), or None when it is
    whole: its manifest there, and every file it lists there with its size and checksum."""
    path = Path(path)
    manifest = path / MANIFEST
    if not path.is_dir():
        return f"{path} is missing"
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = {name: (int(entry["size"]), str(entry["sha256"])) for name, entry in files.items()}
    except FileNotFoundError:
        return f"{manifest} is missing (the checkpoint was not completed)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{manifest} is unreadable ({type(exc).__name__}: {exc})"
    for required in (STATE_FILE, DCP_METADATA):
        if required not in entries:
            return f"{manifest} lists no {required}"
    for name, (size, sha256) in sorted(entries.items()):
        file = path / name
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            return f"{file} is missing"
        if actual != size:
            return f"{file} has {actual} bytes, its manifest says {size} (truncated or overwritten)"
        if _sha256(file) != sha256:
            return f"{file} does not match its manifest's checksum (its bytes were changed, e.g. zeroed)"
    return None


@dataclass
class ResumePoint:
    """The checkpoint a resume loads (`path`; None: the run has none yet) and those passed over, newest first,
    each with why (`skipped`)."""

    path: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def note(self) -> str | None:
        """One line for the log and console when a checkpoint was passed over; None when none was."""
        if not self.skipped or self.path is None:
            return None
        first, reason = self.skipped[0]
        others = f" (and {len(self.skipped) - 1} more damaged)" if len(self.skipped) > 1 else ""
        return (
            f"checkpoint {first.name} is damaged: {reason}{others}; resuming from {self.path.name}, the newest "
            "whole one: the steps after it are trained again"
        )


def _versions(root: Path) -> list[Path]:
    """The `step-<version>` folders under `root`, newest first."""
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_NAME.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: p.name, reverse=True)


def resume_checkpoint(root: str | Path) -> ResumePoint:
    """The checkpoint to resume from under `root`: the one `latest` names if it is whole (`verify_checkpoint`),
    else the newest whole one before it. `ResumePoint(None)` when there is no checkpoint at all (no `latest`, no
    `step-` folder). Raises CheckpointDamaged, naming the damaged file, when there are checkpoints and none is
    whole."""
    root = Path(root)
    pointer = root / LATEST
    steps = _versions(root)
    skipped: list[tuple[Path, str]] = []
    named: Path | None = None
    try:
        name = pointer.read_text().strip()
    except FileNotFoundError:
        name = None
    except (OSError, UnicodeDecodeError) as exc:
        name = ""
        skipped.append((pointer, f"{pointer} is unreadable ({exc})"))
    if name is not None and not skipped:
        if _STEP_NAME.match(name):
            named = root / name
        else:
            skipped.append((pointer, f"{pointer} names {name[:40]!r}, not a checkpoint (damaged)"))
    if name is None and not steps:
        return ResumePoint(None)
    candidates = [named] if named is not None else []
    candidates += [p for p in steps if named is None or p.name < named.name]
    for candidate in candidates:
        reason = verify_checkpoint(candidate)
        if reason is None:
            return ResumePoint(candidate, skipped)
        skipped.append((candidate, reason))
    if not skipped:
        raise CheckpointDamaged(f"{pointer} names no checkpoint")
    others = f" (and {len(skipped) - 1} more damaged or incomplete)" if len(skipped) > 1 else ""
    raise CheckpointDamaged(f"no whole checkpoint in {root}: {skipped[0][1]}{others}")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `latest` names under `root` (unverified: a resume takes `resume_checkpoint`), or None."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(f"{pointer} names {path}, which has no {STATE_FILE}")
    return path
