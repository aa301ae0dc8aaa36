"""One decoding value: caps, the parsed tie rule and top-logit recording built once and keyed by one function.

:meth:`Decoding.key` writes a ledger key's decoding entries and :meth:`Decoding.from_key` reads them back: the two
are inverse on every value and on every committed ledger's key, whose entries they leave as they are.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_CAPS, tracked

from kvreplay.decoding import decode, ties
from kvreplay.decoding.contract import Caps
from kvreplay.decoding.settings import KEY_ENTRIES, Decoding
from kvreplay.runner import ArmSettings, RunSpec


@pytest.mark.parametrize("rule, top", [("lowest", False), ("highest", True), ("hash:7", False), ("hash:0", True)])
def test_the_key_is_read_back_by_its_inverse(rule, top):
    d = Decoding.of(Caps(5, 4, 3), rule, top)
    assert d.tie_rule == ties.parse_tie_rule(rule)  # parsed once, here
    key = d.key()
    assert Decoding.from_key(json.loads(json.dumps(key))) == d
    assert set(key) == {"caps"} | ({"tie_rule"} if rule != "lowest" else set()) | ({"top_logits"} if top else set())


def test_every_committed_ledger_key_round_trips_unchanged():
    """Each committed manifest's decoding entries are exactly what its Decoding writes, and ArmSettings keys them
    so (the keys of committed ledgers do not change)."""
    manifests = tracked("data/ledgers/*/*/manifest.json")
    assert manifests
    for path in manifests:
        config = json.loads(path.read_text())["config"]
        if "caps" not in config:  # the checkpoint metric keys no decoding
            continue
        entries = {k: config[k] for k in KEY_ENTRIES if k in config}
        assert Decoding.from_key(config).key() == entries, path
        settings = ArmSettings(profile="p", dtype="bfloat16", caps=Decoding.from_key(config).caps,
                               tie_rule=Decoding.from_key(config).tie_rule.name,
                               top_logits=Decoding.from_key(config).top_logits)
        assert {k: v for k, v in settings.config("x", []).items() if k in KEY_ENTRIES} == entries, path


def test_a_bad_setting_is_refused_where_the_value_is_built():
    with pytest.raises(ValueError, match="tie_rules\\[0\\]: unknown tie rule 'random'"):
        Decoding.of(TINY_CAPS, "random", where="tie_rules[0]")
    with pytest.raises(ValueError, match="top_logits must be true or false"):
        Decoding.of(TINY_CAPS, "lowest", "yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ledger key tie_rule: unknown tie rule"):
        Decoding.from_key({"caps": {"branch": 1, "merge": 1, "answer": 1}, "tie_rule": "sideways"})
    with pytest.raises(TypeError, match="a parsed TieRule is needed"):
        decode.BlockCursor(None, TINY_CAPS, 0, tie_rule="highest")  # type: ignore[arg-type]  (a name: Decoding.of)
    with pytest.raises(TypeError, match="decoding must be a Decoding"):
        RunSpec(None, None, TINY_CAPS)  # type: ignore[arg-type]


PARSERS = {"decoding/settings.py", "decoding/ties.py"}
"""The modules of lib/kvreplay that may call the tie-rule parser: ties.py defines it, settings.py calls it once."""


def test_the_tie_rule_is_parsed_in_one_place():
    """Only :mod:`kvreplay.decoding.settings` calls :func:`kvreplay.decoding.ties.parse_tie_rule`; every decoder, cursor and the engine
    takes the parsed rule from a :class:`Decoding` (a second parse site fails here, naming it)."""
    lib = Path(decode.__file__).parents[1]
    sites = [f"{path.relative_to(lib)}:{n}" for path in sorted(lib.rglob("*.py")) if str(path.relative_to(lib)) not in PARSERS
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if "parse_tie_rule(" in line]
    assert not sites, f"the tie rule is parsed outside kvreplay.decoding.settings: {sites}"
    calls = [line for line in (lib / "decoding" / "settings.py").read_text().splitlines() if "parse_tie_rule(" in line]
    assert len(calls) == 1, calls
