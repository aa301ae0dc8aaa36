"""Absolute paths of the compendium, in one place (so code runs from any folder)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
BANK_DIR = DATA / "bank"
LEDGERS = DATA / "ledgers"
CHECKPOINTS = DATA / "checkpoints"
FIGURES = ROOT / "figures"
NOTEBOOKS = ROOT / "notebooks"
PARAMS = NOTEBOOKS / "params"
FORMATS = Path(__file__).resolve().parent / "formats"
BUILD = ROOT / "build"
EXECUTED = ROOT / "executed"
