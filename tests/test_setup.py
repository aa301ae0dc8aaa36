"""`make setup` where pip sees PyPI alone: it stops within seconds, before installing anything, with one line
naming the PIPFLAGS to pass (the locked torch is the CPU build 2.13.0+cpu, which PyPI does not have)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from kvreplay.paths import ROOT

LINE = ('error: pip sees no torch==2.13.0+cpu (the CPU build is not on PyPI); run: make setup '
        'PIPFLAGS="--extra-index-url https://download.pytorch.org/whl/cpu"')


def _env_without_pip_config():
    """This machine's pip configuration (a local index and find-links) taken away: pip sees only the empty index
    the test names, as a machine whose pip sees PyPI alone sees no 2.13.0+cpu (offline-safe: nothing is fetched)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return env | {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def test_setup_without_the_torch_index_stops_at_once_with_one_line(tmp_path):
    for name in ("Makefile", "requirements.txt", "requirements-data.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    empty = tmp_path / "empty-index"
    empty.mkdir()
    python = getattr(sys, "_base_executable", sys.executable)
    t = time.perf_counter()
    r = subprocess.run(["make", "--no-print-directory", "setup", f"PYTHON={python}", f"PIPFLAGS=--index-url {empty.as_uri()}"],
                       cwd=tmp_path, env=_env_without_pip_config(), capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t
    assert r.returncode != 0, r.stdout[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [LINE], r.stderr
    assert not (tmp_path / ".venv" / ".stamp").exists()
    assert not list((tmp_path / ".venv").glob("lib/python*/site-packages/torch")), "installed before the check"
    assert took < 120, f"took {took:.0f} s (a venv is created, then the check runs in about a second)"


def test_the_check_passes_where_pip_sees_the_build():
    """This checkout's venv (made by make setup) holds the build; pip's own configuration here also points at it."""
    r = subprocess.run(["make", "--no-print-directory", "-s", "check-index"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
