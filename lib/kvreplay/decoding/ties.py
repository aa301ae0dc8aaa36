"""The greedy tie rule: which token an exact tie of the top eligible logits goes to (an execution-contract parameter).

Greedy decoding takes the highest eligible logit. When two or more eligible tokens share it exactly (common in
BF16, whose logits near the top are spaced 0.0625 or 0.125 apart), a rule must pick one:

* ``lowest`` (the default): the lowest token ID, as ``torch.argmax`` and Hugging Face ``generate(do_sample=False)``;
* ``highest``: the highest token ID;
* ``hash:<seed>``: the tied token at index ``h mod n`` of the ``n`` tied IDs in ascending order, where
  ``h = tie_hash(seed, position, tied IDs)``. Two arms facing the same tie at the same position break it alike.

``position`` is the position ID the chosen token will take (the tokens before it, prompt included).
:func:`tie_hash` is a 32-bit integer hash of our own, built on a murmur3-style finaliser (:func:`mix32`):
``h = mix32(mix32(mix32(seed) ^ position) ^ S)``. Here ``S = sum(mix32(t) for t in tied IDs) mod 2**32``, a
function of the set (hence of its sorted IDs). :func:`choose` computes it on the device with integer ops only,
so the engine's step stays graph-capturable, and both decoders call the same :func:`choose`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch

DEFAULT_TIE_RULE = "lowest"
"""Hugging Face's rule (``torch.argmax``: the first maximal index); it adds nothing to a ledger key."""

TIE_RULES = ("lowest", "highest", "hash:<seed>")
"""The rule names a profile may give (``<seed>`` a whole number from 0 to 2**32 - 1)."""

_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x6C8E9CF5  # odd multipliers below 2**31: every product of a 32-bit value fits in int64
_HASH = re.compile(r"hash:([0-9]+)")  # fullmatch, ASCII digits only: no "hash:0\n", no "hash:٣"


@dataclasses.dataclass(frozen=True)
class TieRule:
    """A parsed tie rule: ``kind`` is ``"lowest"``, ``"highest"`` or ``"hash"``; ``seed`` is the hash's (else 0)."""
    kind: str
    seed: int = 0

    @property
    def name(self) -> str:
        """The rule as written in a profile and a ledger key (``"hash:0"``)."""
        return f"hash:{self.seed}" if self.kind == "hash" else self.kind


LOWEST = TieRule("lowest")
"""The default rule, parsed (:data:`DEFAULT_TIE_RULE`): what a decoder given no :class:`~kvreplay.decoding.settings.Decoding`
uses."""


def check_parsed(rule: object, where: str) -> TieRule:
    """``rule`` itself when it is a parsed :class:`TieRule`; decoders take rules parsed, never their names.

    Raises:
        TypeError: anything else (a name: build a :class:`~kvreplay.decoding.settings.Decoding` with ``Decoding.of``)."""
    if not isinstance(rule, TieRule):
        raise TypeError(f"{where}: a parsed TieRule is needed, got {rule!r} (kvreplay.decoding.settings.Decoding.of parses a "
                        f"rule's name)")
    return rule


def parse_tie_rule(rule: "str | TieRule", where: str = "tie_rule") -> TieRule:
    """Parse a rule name (:data:`TIE_RULES`).

    Raises:
        ValueError: naming ``where``, for anything else (``hash:`` without a whole seed of ASCII digits, surrounding
            whitespace, a seed of 2**32 or more).

    :attr:`TieRule.name` is the rule's one canonical spelling (``"hash:07"`` -> ``"hash:7"``), the one a ledger key holds.
    """
    if isinstance(rule, TieRule):
        return rule
    if rule in ("lowest", "highest"):
        return TieRule(rule)
    m = _HASH.fullmatch(rule) if isinstance(rule, str) else None
    if m is None or int(m.group(1)) > _MASK:
        raise ValueError(f"{where}: unknown tie rule {rule!r}; use 'lowest', 'highest' or 'hash:<seed>' with a seed "
                         f"from 0 to {_MASK}")
    return TieRule("hash", int(m.group(1)))


def mix32(x: int) -> int:
    """The 32-bit integer finaliser of :func:`tie_hash` (Python ints; :func:`choose` does the same on int64 tensors)."""
    x &= _MASK
    x ^= x >> 16
    x = (x * _M1) & _MASK
    x ^= x >> 15
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def tie_hash(seed: int, position: int, tied: Iterable[int]) -> int:
    """The hash rule's 32-bit value for a tie (the reference :func:`choose` must equal).

    Args:
        seed: the rule's seed; position: the chosen token's position ID; tied: the tied token IDs (any order).
    """
    s = sum(mix32(t) for t in set(tied)) & _MASK
    return mix32(mix32(mix32(seed) ^ (position & _MASK)) ^ s)


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x & _MASK
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def choose(masked: torch.Tensor, rule: TieRule, position: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy choice of each row under a tie rule, on the device, without a host sync.

    Args:
        masked: ``[rows, vocab]`` float32 logits, ineligible tokens ``-inf``.
        rule: the parsed rule (:class:`TieRule`).
        position: ``[rows]`` int64 position IDs of the tokens being chosen (needed by ``hash`` only).

    Returns:
        ``[rows]`` int64 token IDs. ``lowest`` is ``masked.argmax(-1)`` itself. A row without a finite
        maximum (NaN) still gets an index; the ``nonfinite`` gate stops such a row.

    Raises:
        TypeError: a rule not parsed (:func:`check_parsed`); ValueError: ``hash`` without ``position``.
    """
    r = check_parsed(rule, "tie rule")
    if r.kind == "lowest":
        return masked.argmax(-1)
    vocab = masked.shape[-1]
    ids = torch.arange(vocab, device=masked.device)
    tied = masked == masked.amax(-1, keepdim=True)
    if r.kind == "highest":
        return torch.where(tied, ids, -1).amax(-1)
    if position is None:
        raise ValueError("tie rule 'hash' needs the position of the token being chosen")
    count = tied.sum(-1)
    s = torch.where(tied, _mix(ids), 0).sum(-1) & _MASK  # below 2**56 before the mask: vocab < 2**24
    h = _mix(_mix(torch.full_like(count, r.seed)) ^ (position & _MASK))
    h = _mix(h ^ s)
    k = h % count.clamp(min=1)
    rank = tied.cumsum(-1) - 1
    return torch.where(tied & (rank == k[:, None]), ids, vocab).amin(-1).clamp(max=vocab - 1)
