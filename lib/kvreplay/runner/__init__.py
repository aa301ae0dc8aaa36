"""Running an experiment arm: its settings, the run loop, and Ray row actors (paper §3.9).

An *arm* is one experiment at one precision under one execution contract.

* :mod:`.spec`: :class:`ArmSettings` (everything that decides an arm's bits,
  and the ledger key built from it) and the execution contract the notebooks pass as
  their ``execution`` parameter (:data:`EXECUTION_DEFAULTS`, :func:`resolve_execution`).
  Also :class:`RunSpec` (what a per-row function receives), the batched engine's resolved
  settings, prompt checks and :data:`ROW_ALGORITHM`, the version of each experiment's row function;
* :mod:`.batched`: :class:`BatchedRows`, an arm's rows a chunk at a time on the batched engine, with its
  preflight gates and chunk deadline, and the leaf-by-leaf record comparison behind them;
* :mod:`.loop`: :func:`run_arm`, which runs, resumes or reuses an arm's ledger;
* :mod:`.arms`: :class:`Arm`, the one declaration of an experiment arm (row and chunk functions, inputs,
  ledger key), and :class:`ArmPlan`, an arm bound to its problems, prefixes and key entries;
* :mod:`.actors`: :class:`~kvreplay.runner.actors.RowActors`, rows spread over
  Ray actors (one per GPU or CPU worker), records appended in problem order.

The names an experiment module needs are re-exported here.
"""

from .batched import (
    CHUNK_DEADLINE_ENV,
    FIRST_CHUNK_ESTIMATE_ENV,
    GRAPH_CHECK_STEPS,
    BatchedRows,
    ChunkDeadline,
    first_difference,
    leaves,
)
from .arms import Arm, ArmPlan, Chain
from .kept import keep_models
from .loop import READ_ONLY_ENV, ReadOnlyLedgerError, run_arm
from .spec import (
    ARM_STEP_PATHS,
    ENGINE_KEYS,
    EXECUTION_DEFAULTS,
    EXECUTION_KEYS,
    EXECUTION_KINDS,
    ROW_ALGORITHM,
    ArmSettings,
    EngineRun,
    Hook,
    RunSpec,
    arm_environment,
    check_execution,
    check_prompts,
    model_key,
    problems_digest,
    resolve_execution,
    role_table_key,
)

__all__ = [
    "ARM_STEP_PATHS", "CHUNK_DEADLINE_ENV", "ENGINE_KEYS", "EXECUTION_DEFAULTS", "EXECUTION_KEYS", "EXECUTION_KINDS", "FIRST_CHUNK_ESTIMATE_ENV",
    "GRAPH_CHECK_STEPS", "READ_ONLY_ENV", "ROW_ALGORITHM", "Arm", "ArmPlan", "ArmSettings", "Chain", "BatchedRows", "ChunkDeadline", "EngineRun", "Hook", "ReadOnlyLedgerError", "RunSpec",
    "arm_environment", "check_execution", "check_prompts", "first_difference", "keep_models", "leaves", "model_key", "problems_digest",
    "resolve_execution",
    "role_table_key", "run_arm",
]
