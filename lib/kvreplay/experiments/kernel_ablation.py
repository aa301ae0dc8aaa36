"""The attribution control of the invariant-kernel contract: which operation class, left in its default reduction
order, brings back the prefill-versus-live cache drift and the BF16 suffix divergence.

Each kernels value (:data:`kvreplay.kernels.KERNELS`: ``default``, ``invariant`` and every
``invariant-except-<class>``) is its own arm with its own ledger key (:meth:`kvreplay.runner.ArmSettings.config`
with ``kernels``). A row is Experiment 1's comparison under that value. Greedy live decoding reaches the merge
boundary and a prefill runs over the same IDs. The two boundary caches are compared on every layer, one greedy
suffix is decoded from each, where they part is found, and both answers are scored. Under ``invariant`` the caches
coincide by construction (the contract's test, not a finding); the finding is which ``invariant-except-<class>``
arm brings drift and divergence back. Outcomes are recorded and tabulated, never asserted. The command is ``scripts/kernel_ablation.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any, cast

from .. import decode
from ..contract import BlockFormat, Caps
from ..drift import aggregate, cache_drift
from ..gates import cache_tensors
from ..models import LoadedModel
from ..problems import Problem
from ..scoring import score_answer

ROW_ALGORITHM = 1
"""Row-algorithm version of this control's ledgers (bumped whenever a row's bytes change)."""


def _answer(lm: LoadedModel, fmt: BlockFormat, problem: Problem, suffix: decode.Suffix) -> dict:
    text = fmt.answer_prefix_text + cast(str, lm.tokenizer.decode(suffix.answer))
    score = score_answer(text, problem.answer, problem.options)
    return {"suffix": suffix.tokens, "margins": suffix.margins, "answer_text": text, "predicted": score.predicted,
            "correct": score.correct}


def ablation_row(lm: LoadedModel, fmt: BlockFormat, problem: Problem, caps: Caps) -> dict:
    """One problem under ``lm``'s kernels value: live vs prefill boundary and suffixes.

    Returns:
        ``{"problem_id", "kernels", "prefix" (token IDs of z), "drift" (whole-cache: exact, rel_l2, max_abs,
        n_diff, numel), "logits_exact", "live", "prefill" (each: suffix IDs, margins, answer text, predicted
        letter, correct), "diverged", "first_divergence" (suffix step or None), "tie_initiated" (either arm's
        margin exactly 0 there)}``.

    Raises:
        GateError: ``desync`` or ``nonfinite`` (the eager decoders' gates).
    """
    live = decode.decode_live(lm, fmt, fmt.prompt_ids(problem.question, problem.options), caps)
    pre = decode.build_prefill(lm, fmt, live.ids)
    drift = aggregate(cache_drift(cache_tensors(live.cache), cache_tensors(pre.cache)))
    logits_exact = bool((live.logits == pre.logits).all())
    a = decode.decode_suffix(lm, fmt, live, caps)
    b = decode.decode_suffix(lm, fmt, pre, caps)
    first = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    if first is None and len(a.tokens) != len(b.tokens):
        first = min(len(a.tokens), len(b.tokens))
    tie = first is not None and any(m is not None and m == 0.0 and i == first
                                    for s in (a, b) for i, m in enumerate(s.margins))
    return {
        "problem_id": problem.problem_id,
        "kernels": decode.kernels_of(lm),
        "prefix": live.ids,
        "drift": {k: drift[k] for k in ("exact", "rel_l2", "max_abs", "n_diff", "numel")},
        "logits_exact": logits_exact,
        "live": _answer(lm, fmt, problem, a),
        "prefill": _answer(lm, fmt, problem, b),
        "diverged": first is not None,
        "first_divergence": first,
        "tie_initiated": tie,
    }


def ablation_table(rows_by_value: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """A markdown table, one line per kernels value: rows, caches bit-identical, median (range) relative L2 of
    prefill vs live, suffixes parted (of those begun at an exact tie), live and prefill accuracy."""
    head = ("| kernels | rows | prefill cache = live, bit for bit | rel. L2 prefill vs live, median [range] | "
            "suffixes part (tie-initiated) | live correct | prefill correct |\n|---|---|---|---|---|---|---|\n")
    lines = []
    for value, rows in rows_by_value.items():
        n = len(rows)
        if not n:
            continue
        rel = [r["drift"]["rel_l2"] for r in rows]
        parted = sum(r["diverged"] for r in rows)
        ties = sum(r["tie_initiated"] for r in rows)
        lines.append(f"| `{value}` | {n} | {sum(r['drift']['exact'] for r in rows)}/{n} | "
                     f"{statistics.median(rel):.2e} [{min(rel):.2e}, {max(rel):.2e}] | {parted}/{n} ({ties}) | "
                     f"{sum(bool(r['live']['correct']) for r in rows)}/{n} | "
                     f"{sum(bool(r['prefill']['correct']) for r in rows)}/{n} |")
    return head + "\n".join(lines) + "\n"
