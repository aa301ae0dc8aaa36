"""What every decoder needs to choose a token, as one value: :class:`Decoding` (paper §3.3, §3.9).

The content caps, the greedy tie rule (parsed once, :mod:`kvreplay.decoding.ties`) and whether each suffix step's top-1
eligible logit is kept are built once from a profile (``runner.ArmSettings.decoding``). Row and chunk functions pass
the value whole to the eager decoders (:mod:`kvreplay.decoding.decode`) and the batched ones (:mod:`kvreplay.engine`), which
hand the parsed rule to their cursors and the engine's step. :meth:`Decoding.of` is the one place a setting is
parsed and checked (:func:`parse_rule` for a rule alone, e.g. a profile's list of rules). Its ledger-key entries are
written by :meth:`Decoding.key` and read back by its inverse :meth:`Decoding.from_key`; a setting at its default
writes nothing, so ledgers written before the setting existed keep their keys.

Adding a setting that every decoder needs is one field here with its default, its parameter and check in
:meth:`Decoding.of`, and its entry in :data:`KEY_ENTRIES` (how it is written to and read back from the ledger key).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from . import ties
from .contract import Caps

_DEFAULT_RULE = ties.LOWEST


def parse_rule(rule: "str | ties.TieRule", where: str = "tie_rule") -> ties.TieRule:
    """A tie rule's name parsed (:func:`kvreplay.decoding.ties.parse_tie_rule`): the one call of the parser, shared by
    :meth:`Decoding.of` and the profile's checks of a rule given alone (``execution``'s ``tie_rule``, ``tie_rules``).

    Raises:
        ValueError: an unknown rule, naming ``where``."""
    return ties.parse_tie_rule(rule, where)


@dataclasses.dataclass(frozen=True)
class Decoding:
    """The decoding settings shared by every decoder.

    Attributes:
        caps: content caps per block (tokens).
        tie_rule: which of exactly tied eligible tokens is chosen, parsed (:class:`kvreplay.decoding.ties.TieRule`).
        top_logits: each suffix step also keeps its top-1 eligible logit (float32 logit units).

    Build it with :meth:`of` (a rule given by name is parsed there, the one place), or from a ledger key with
    :meth:`from_key`.
    """
    caps: Caps
    tie_rule: ties.TieRule = _DEFAULT_RULE
    top_logits: bool = False

    @classmethod
    def of(cls, caps: Caps, tie_rule: "str | ties.TieRule" = ties.DEFAULT_TIE_RULE, top_logits: bool = False,
           where: str = "tie_rule") -> "Decoding":
        """The value from a profile's settings, each parsed and checked here.

        Raises:
            ValueError: an unknown tie rule, naming ``where``; ``top_logits`` not a bool.
        """
        if not isinstance(top_logits, bool):
            raise ValueError(f"top_logits must be true or false, got {top_logits!r}")
        if not isinstance(caps, Caps):
            raise ValueError(f"caps must be a Caps (branch, merge, answer), got {caps!r}")
        return cls(caps, parse_rule(tie_rule, where), top_logits)

    @classmethod
    def given(cls, decoding: "Decoding | Caps") -> "Decoding":
        """What a decoder's ``decoding`` argument means: a :class:`Decoding` as it is; caps alone at the default
        tie rule without top logits."""
        return decoding if isinstance(decoding, Decoding) else cls.of(decoding)

    def key(self) -> dict[str, Any]:
        """Its entries of a ledger key: ``caps`` always; ``tie_rule`` (its name) and ``top_logits`` only when not at
        their defaults (:data:`KEY_ENTRIES`)."""
        out: dict[str, Any] = {}
        for name, (write, _read, default) in KEY_ENTRIES.items():
            value = getattr(self, name)
            if default is _ALWAYS or value != default:
                out[name] = write(value)
        return out

    @classmethod
    def from_key(cls, config: Mapping[str, Any]) -> "Decoding":
        """The inverse of :meth:`key`: the value a ledger key (a manifest's ``config``) was written from.

        Raises:
            KeyError: no ``caps`` in ``config``; ValueError: an entry that does not parse (checked by :meth:`of`).
        """
        given = {name: read(config[name]) for name, (_write, read, default) in KEY_ENTRIES.items()
                 if name in config or default is _ALWAYS}
        return cls.of(**given, where="ledger key tie_rule")


_ALWAYS = object()  # a key entry written whatever its value

KEY_ENTRIES: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any], Any]] = {
    "caps": (dataclasses.asdict, lambda v: Caps(**v), _ALWAYS),
    "tie_rule": (lambda rule: rule.name, lambda v: v, _DEFAULT_RULE),
    "top_logits": (bool, lambda v: v, False),
}
"""Field of :class:`Decoding` -> (its key entry from the value, the argument of :meth:`Decoding.of` from its entry,
the default at which it is left out of the key, or ``_ALWAYS``). One line per setting; :meth:`Decoding.of` checks."""
