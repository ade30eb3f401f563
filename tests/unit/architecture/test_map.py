"""docs/ARCHITECTURE.md names files at each stage of a row's life: every path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PATH = re.compile(r"`((?:fleetrl|services|tests|bench|examples|k8s|monitoring|scripts)/[\w/.<>-]+?)(?:::\w+)?`")


def test_every_file_the_map_names_exists() -> None:
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    named = {m.group(1) for m in PATH.finditer(text) if "<" not in m.group(1)}
    assert len(named) > 40, "the map names too few files: the pattern no longer matches it"
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"docs/ARCHITECTURE.md names files that do not exist: {missing}"
