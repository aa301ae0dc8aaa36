"""The repository stays light enough to travel: a device call carries the tracked tree plus one model part."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACKED_LIMIT = 24 * 2**20
"""Bytes the tracked files may take: a device call carries at most 64 MiB, and the embedded GGUF travels
beside the tree in parts of 48 MiB."""


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:  # a source tarball without .git
        pytest.skip(f"not a git checkout ({e})")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_tracked_tree_fits_beside_a_model_part():
    files = [f for f in tracked_files() if f.is_file()]
    total = sum(f.stat().st_size for f in files)
    biggest = sorted(files, key=lambda f: f.stat().st_size, reverse=True)[:5]
    assert total <= TRACKED_LIMIT, (
        f"tracked files take {total / 2**20:.1f} MiB, over {TRACKED_LIMIT / 2**20:.0f} MiB; largest: "
        + ", ".join(f"{f.relative_to(ROOT)} ({f.stat().st_size / 2**20:.1f} MiB)" for f in biggest))
