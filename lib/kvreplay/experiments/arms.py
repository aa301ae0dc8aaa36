"""Every experiment arm of the chain by name: the declarations of notebooks 01-05 and 09 (paper §3.9).

Each arm is declared once, in its experiment's module (:class:`kvreplay.runner.Arm`); this table is what
``make verify``, the ledger-key tests and ``scripts/gpu_profile.py`` look arms up in.
"""

from __future__ import annotations

from typing import Any

from ..runner.arms import Arm
from .bridge import EXP3
from .controls import EXP2_CONTROLS
from .fixed_prefix import EXP2
from .kernel_ablation import EXP2_KERNELS
from .length_arm import EXP1_LENGTH
from .live_vs_prefill import EXP1
from .replication import EXP5
from .tie_rules import EXP1_TIES
from .transplant import EXP4

ARMS: dict[str, Arm[Any]] = {a.experiment: a for a in (EXP1, EXP1_TIES, EXP1_LENGTH, EXP2, EXP2_CONTROLS, EXP3, EXP4, EXP5,
                                                      EXP2_KERNELS)}
"""Experiment (the ledger label's first part) -> its arm, in chain order."""


def arm(experiment: str) -> Arm[Any]:
    """The declaration of one experiment's arm.

    Raises:
        ValueError: naming the experiments that have one.
    """
    if experiment not in ARMS:
        raise ValueError(f"no arm is declared for experiment {experiment!r}; arms: {', '.join(ARMS)}")
    return ARMS[experiment]
