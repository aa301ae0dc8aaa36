"""Models kept across the arms of one process (a GPU profile's one command, paper §3.9).

:func:`keep_models` opens a scope in which :func:`load_kept` (what :meth:`kvreplay.runner.ArmSettings.load` calls)
loads each model once per precision, role table and execution contract and hands the same
:class:`~kvreplay.model.models.LoadedModel` to every later arm. Outside it each call loads its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from ..model.execution import ExecutionContract
from ..ledger.store import canonical_json
from ..model.models import LoadedModel, load_model

_KEPT: dict[str, LoadedModel] | None = None
"""The models :func:`keep_models` keeps, by model, precision, role table and execution contract; ``None``: none."""


def load_kept(model: str | Path, dtype: str, role_table: str | Path | None, contract: ExecutionContract) -> LoadedModel:
    """:func:`~kvreplay.model.models.load_model`, or inside :func:`keep_models` the model it loaded before for the same
    model, precision, role table and contract (the contract applied again, as a load applies it).

    Raises:
        ModelLoadError: as :func:`~kvreplay.model.models.load_model`.
    """
    kept = _KEPT
    key = canonical_json({"model": str(model), "dtype": dtype, "role_table": str(role_table), "contract": repr(contract)})
    if kept is not None and key in kept:
        contract.apply()
        return kept[key]
    lm = load_model(model, dtype, role_table=role_table, contract=contract)
    if kept is not None:
        kept[key] = lm
    return lm


@contextlib.contextmanager
def keep_models() -> Iterator[dict[str, LoadedModel]]:
    """A scope in which each model loads once per precision, role table and execution contract.

    A GPU profile runs its arms in one process this way (``scripts/gpu_profile.py``): one load and one self-check
    per model, and torch's compiled kernels serve every arm of one shape. Outside it (notebooks, tests) each arm
    loads its own, so a test that plants a fault in a model never reaches another arm. No bit depends on it: the
    weights are loaded from the same digest-checked file.

    Yields:
        the mapping of the models kept (a key -> :class:`~kvreplay.model.models.LoadedModel`).
    """
    global _KEPT
    outer = _KEPT
    _KEPT = {} if outer is None else outer
    try:
        yield _KEPT
    finally:
        _KEPT = outer
