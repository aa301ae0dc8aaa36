"""Experiment 1: the live cache of ordinary greedy decoding against a prefill of the same token IDs (paper §4.1).

Each problem is decoded greedily through branch, merge and answer blocks;
the live cache at the merge boundary is the reference of the four-arm matrix
(:mod:`kvreplay.experiments.matrix`). The BF16 arm's boundary prefixes become
the fixed-prefix bank of Experiments 2–5 (:func:`kvreplay.ledger.prefix_bank.write_prefix_bank`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from ..arm_facts import declared_in
from ..decoding import decode
from .. import engine
from ..engine import Measured
from ..gates import GateError
from ..ledger.records import Exp1Record
from ..data.problems import Problem
from ..runner import RunSpec
from ..runner.arms import Arm, ArmPlan, Chain
from .matrix import gate_failure, matrix_chunk, matrix_pipeline, matrix_row


def live_vs_prefill_row(spec: RunSpec, problem: Problem) -> Exp1Record:
    """Experiment 1 for one problem: live decoding to the boundary, then the four-arm matrix (paper §3.5).

    The problem is first checked as the run loop checks it (:meth:`RunSpec.check_problem`); the model was
    checked when ``spec`` was built. In a run below float32 the live boundary of a row in
    ``spec.live_check_ids`` must equal its incremental rebuild bit for bit (:func:`~.matrix.check_live`).

    Returns:
        The ledger record; on a gate failure, a record with ``gate_failure``
        ``{"gate", "reason"}`` (and the prefix if the boundary was reached).

    Raises:
        ContractError: the problem breaks the block contract or needs more positions than the model has.
    """
    spec.check_problem(problem)
    rec: dict[str, Any] = {"problem_id": problem.problem_id, "gate_failure": None}
    try:
        prompt = spec.fmt.prompt_ids(problem.question, problem.options)
        live = decode.decode_live(spec.lm, spec.fmt, prompt, spec.decoding)
        rec.update(prompt_len=len(prompt), prefix_len=len(live.ids), prefix=live.ids, schedule_calls=len(live.schedule))
        matrix_row(spec, problem, rec, live)
    except GateError as e:
        rec["gate_failure"] = gate_failure(e)
    return cast(Exp1Record, rec)  # built stage by stage; run_arm checks it against the record before appending


def live_vs_prefill_chunk(spec: RunSpec, problems: Sequence[Problem]) -> Measured[Exp1Record]:
    """Experiment 1 for a chunk of problems through the batched engine (the records of :func:`live_vs_prefill_row`).

    Live boundaries and the four arms' suffixes run in one engine (:func:`matrix_pipeline`). A problem whose
    live boundary is done gets its matrix, and its suffixes decode while other problems still decode live; a
    slot a job leaves takes the next one at once. The records equal those of the phase-wise schedule
    (:func:`kvreplay.engine.decode_lives`, then :func:`matrix_chunk`) bit for bit. Bits may differ
    from :func:`live_vs_prefill_row` (another cache layout and batch shape: the ledger key says which), the
    layout does not. The records come with what the engine measured.

    Raises:
        ContractError: a prompt that breaks the block contract or needs more positions than the model has
            (before any decoding), or an unclosed answer block.
        GateError: the engine's own gates (``graph_equals_eager``, ``attention_tolerance``).
    """
    for p in problems:
        spec.check_problem(p)
    prompts = [spec.fmt.prompt_ids(p.question, p.options) for p in problems]
    return cast(Measured[Exp1Record], matrix_pipeline(spec, problems, "live", prompts, [_head(x) for x in prompts]))


def _head(prompt: Sequence[int]):
    """The prefix fields of an Experiment 1 record, from the prompt and the live boundary."""
    return lambda rec, live: rec.update(prompt_len=len(prompt), prefix_len=len(live.ids), prefix=live.ids,
                                        schedule_calls=len(live.schedule))


def live_vs_prefill_chunk_phased(spec: RunSpec, problems: Sequence[Problem]) -> Measured[Exp1Record]:
    """:func:`live_vs_prefill_chunk` phase by phase (every live boundary, then every suffix): the same records.

    The schedule the engine had before boundaries and suffixes shared its slots; the tests compare the two.

    Raises:
        ContractError: a prompt that breaks the block contract or needs more positions than the model has
            (before any decoding), or an unclosed answer block.
    """
    for p in problems:
        spec.check_problem(p)
    prompts = [spec.fmt.prompt_ids(p.question, p.options) for p in problems]
    lives = engine.decode_lives(spec.lm, spec.fmt, prompts, spec.decoding, run=spec.batched(), on_gate_error="return")
    recs = matrix_chunk(spec, problems, lives, [_head(x) for x in prompts])
    return cast(Measured[Exp1Record], Measured(recs, lives.stats + recs.stats))


def _prepare(chain: Chain) -> ArmPlan[Exp1Record]:
    """Experiment 1 under a session: the first ``n_rows`` problems of the bank, ``preflight`` of them preflight rows."""
    return EXP1.plan(chain.rows(chain.params.n_rows), preflight=chain.params.preflight)


EXP1: Arm[Exp1Record] = Arm(
    declared_in(__name__), row=lambda spec, problem, plan: live_vs_prefill_row(spec, problem),
    chunk=lambda spec, problems, plan: live_vs_prefill_chunk(spec, problems),
    prepare=_prepare, live_check=True)
"""Experiment 1 (paper §3.5): live decoding, then the four-arm matrix; nothing added to the ledger key.

Below float32, the preflight rows and a sample of ``live_check_fraction`` of the others carry the
``live_equals_incremental`` gate."""
