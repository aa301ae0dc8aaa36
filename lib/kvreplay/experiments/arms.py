"""Every experiment arm of the chain by name: the declarations of notebooks 01-05 and 09 (paper §3.9).

Each arm is declared once, in the module its facts name (:attr:`kvreplay.arm_facts.ArmFacts.module`, a
:class:`kvreplay.runner.Arm`); this table is what ``make verify``, the ledger-key tests and
``scripts/gpu_profile.py`` look arms up in. It is derived from :data:`kvreplay.arm_facts.ARM_FACTS`: an arm's
module is imported when it is first read.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ..arm_facts import Derived, chain_facts
from ..runner.arms import Arm


def _declared(module: str, experiment: str) -> Arm[Any]:
    """The one :class:`Arm` of ``experiment`` among the module-level names of ``kvreplay.experiments.<module>``.

    Raises:
        ValueError: the module declares none, or more than one.
    """
    found = {id(v): v for v in vars(importlib.import_module(f"{__package__}.{module}")).values()
             if isinstance(v, Arm) and v.experiment == experiment}
    if len(found) != 1:
        raise ValueError(f"kvreplay.experiments.{module} declares {len(found)} arms of {experiment!r} (expected one)")
    return next(iter(found.values()))


ARMS: Mapping[str, Arm[Any]] = Derived(lambda: {f.experiment: _declared(str(f.module), f.experiment)
                                                for f in chain_facts()})
"""Experiment (the ledger label's first part) -> its arm, in chain order."""


def arm(experiment: str) -> Arm[Any]:
    """The declaration of one experiment's arm.

    Raises:
        ValueError: naming the experiments that have one.
    """
    if experiment not in ARMS:
        raise ValueError(f"no arm is declared for experiment {experiment!r}; arms: {', '.join(ARMS)}")
    return ARMS[experiment]
