"""What an arm checks before its first row is decoded: which rows get the live check, and that every prompt
builds and fits the model's context (paper §3.9). Re-exported by :mod:`kvreplay.runner.spec`.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..contract import BlockFormat, Caps, ContractError
from ..problems import Problem


LIVE_CHECK_FRACTION = 1.0
"""Default share of an arm's non-preflight rows whose live boundary is checked (``ArmSettings.live_check_fraction``).

Every row. The check replays the live call schedule once more: as many forward calls (engine: steps) as live
decoding. Measured with the embedded model in BF16 on 2 CPU cores (eager path): +25 to +54 % forward calls per
row at the cpu profile's caps (36 s of checks on 121 s of three rows, +30 %), +51 % at smoke caps; the engine's
eager path at smoke caps (B = 2): +51 % calls. On the engine a smaller fraction saves little: a chunk's sampled
problems are rebuilt together, and a step with idle slots costs as much as a full one.
"""

LIVE_CHECK_SALT = "live_equals_incremental"
"""Salt of the live-check sample's hash (:func:`live_check_ids`)."""


def live_check_ids(problem_ids: Sequence[str], preflight: int, fraction: float) -> frozenset[str]:
    """The rows whose live boundary is checked (gate ``live_equals_incremental``), fixed before any row is computed.

    The first ``preflight`` rows always; any other row when ``u < fraction``, where ``u`` in [0, 1) is the first
    64 bits of sha256(``"live_equals_incremental:<problem_id>"``) over 2**64. Outcome-blind, and a problem's
    membership does not depend on the other problems or their order.

    Args:
        problem_ids: the arm's problems in frozen order.
        preflight: the arm's preflight rows.
        fraction: the share of the other rows to sample, in [0, 1] (1: every row).

    Raises:
        ValueError: ``fraction`` outside [0, 1].
    """
    import hashlib

    if not 0 <= fraction <= 1:
        raise ValueError(f"live_check_fraction must lie in [0, 1], got {fraction!r}")

    def drawn(pid: str) -> bool:
        u = int(hashlib.sha256(f"{LIVE_CHECK_SALT}:{pid}".encode()).hexdigest()[:16], 16) / 2**64
        return u < fraction

    return frozenset(list(problem_ids)[:preflight]) | frozenset(p for p in problem_ids if drawn(p))


def check_prompts(
    fmt: BlockFormat, problems: Sequence[Problem], max_positions: int | None = None, *, caps: Caps | None = None,
) -> None:
    """Build every prompt before a run so a bad problem fails before any row is decoded.

    With ``max_positions`` (the model's context) and ``caps``, refuse also a problem whose longest full sequence
    (:meth:`BlockFormat.max_sequence_length`: prompt + every delimiter +
    3 x branch cap + merge cap + answer cap, in tokens) needs more positions
    than the model has.

    Args:
        fmt: the resolved block format.
        problems: the arm's problems.
        max_positions: positions the model supports (``max_position_embeddings``), or ``None`` to skip the length check.
        caps: content caps; required when ``max_positions`` is given.

    Raises:
        ContractError: naming the problem ID, its file and line (:attr:`~kvreplay.problems.Problem.where`)
            and, for the length check, the positions needed and available.
        ValueError: ``max_positions`` given without ``caps``.
    """
    if max_positions is not None and caps is None:
        raise ValueError("check_prompts: max_positions needs the caps to bound the sequence length")
    for p in problems:
        try:
            ids = fmt.prompt_ids(p.question, p.options)
        except ContractError as e:
            raise ContractError(f"problem {p.problem_id} ({p.where}): {e}") from e
        if max_positions is None:
            continue
        assert caps is not None  # refused above: max_positions is given, so caps is too
        need = fmt.max_sequence_length(len(ids), caps)
        if need > max_positions:
            raise ContractError(
                f"problem {p.problem_id} ({p.where}): its full sequence can need {need} "
                f"positions (prompt {len(ids)} tokens + delimiters {fmt.delimiter_tokens()} + 3 x branch cap "
                f"{caps.branch} + merge cap {caps.merge} + answer cap {caps.answer}), but the model has only "
                f"{max_positions} (max_position_embeddings). Shorten the question, lower the caps, or leave the "
                f"problem out."
            )
