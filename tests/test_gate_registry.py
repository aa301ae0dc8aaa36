"""One gate registry (kvreplay.gates.GATES): every gate is named once, every raise site names a registered gate, every
registered gate has a planted-fault test that makes it fire, and docs/gates.md lists them (paper §3.5)."""

from __future__ import annotations

import ast
import dataclasses

import pytest
import torch
from conftest import TINY_CAPS, tiny_lm, tiny_problems
from kvreplay.decoding import decode
from kvreplay import gates
from kvreplay.decoding.settings import Decoding
from kvreplay.gates import GATES, GateError
from kvreplay.paths import ROOT
from kvreplay.runner import RunSpec

TESTS = ROOT / "tests"


def _marked_gates() -> dict[str, list[str]]:
    """Gate name -> the test files holding a ``pytest.mark.gate(name)`` (decorator or ``pytest.param(marks=...)``)."""
    out: dict[str, list[str]] = {}
    for path in sorted(TESTS.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "gate"
                    and ast.unparse(node.func.value) == "pytest.mark"):
                assert node.args and isinstance(node.args[0], ast.Constant), f"{path.name}:{node.lineno}"
                out.setdefault(node.args[0].value, []).append(path.name)
    return out


def test_every_registered_gate_has_a_planted_fault_test():
    """conftest's ``pytest_runtest_call`` fails a marked test whose planted fault does not make its gate fire."""
    marked = _marked_gates()
    assert set(marked) <= set(GATES), f"markers name unregistered gates: {sorted(set(marked) - set(GATES))}"
    missing = [g for g in GATES if g not in marked]
    assert not missing, f"registered gates with no @pytest.mark.gate planted-fault test: {missing}"


def test_every_raise_site_names_a_registered_gate():
    """A literal gate name anywhere in the library (``GateError("x", ...)`` or a ``gate=``/first argument of the
    gates' checks) is registered; a name passed through a variable is checked when the error is built."""
    checks = {"GateError", "check_equal_sequences", "check_identical"}
    seen = set()
    for path in sorted((ROOT / "lib" / "kvreplay").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            literal = [a for a in node.args[:1] if name in checks and isinstance(a, ast.Constant)]
            literal += [k.value for k in node.keywords if k.arg == "gate" and isinstance(k.value, ast.Constant)]
            for a in literal:
                assert a.value in GATES, f"{path.relative_to(ROOT)}:{node.lineno}: unregistered gate {a.value!r}"
                seen.add(a.value)
    assert len(seen) >= len(GATES) - 2, sorted(set(GATES) - seen)  # the rest pass through gate=... parameters


def test_gate_error_refuses_an_unregistered_name_and_each_gate_is_described():
    with pytest.raises(ValueError, match=r"unregistered gate 'replicas'; kvreplay.gates.GATES names nonfinite, desync"):
        GateError("replicas", "x")
    e = GateError("desync", "r")
    assert e.gate == "desync" and str(e) == "gate 'desync' failed: r"
    for g in GATES.values():
        assert g.checks.endswith(".") and g.section.startswith("§") and g.where, g


def test_docs_gates_is_generated_from_the_registry():
    doc = (ROOT / "docs" / "gates.md").read_text()
    assert doc == gates.gates_markdown(), "docs/gates.md is stale: run .venv/bin/python -m kvreplay.gates"
    assert all(f"| `{name}` |" in doc for name in GATES)


def test_the_marker_check_can_fail(pytester):
    """A marked test whose fault makes another gate fire, or none, fails; one that makes its gate fire passes."""
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(test_planted="""
        import pytest
        from kvreplay.gates import GateError

        @pytest.mark.gate("desync")
        def test_wrong_gate():
            with pytest.raises(GateError):
                raise GateError("replica", "planted")

        @pytest.mark.gate("desync")
        def test_no_gate():
            pass

        @pytest.mark.gate("desync")
        def test_right_gate():
            with pytest.raises(GateError):
                raise GateError("desync", "planted")
    """)
    result = pytester.runpytest("-q", "-p", "no:cacheprovider", "-o", "addopts=")
    result.assert_outcomes(passed=1, failed=2)
    out = result.stdout.str()
    assert "test_wrong_gate: its planted fault never made gate(s) ['desync'] fire (fired: ['replica'])" in out
    assert "test_no_gate: its planted fault never made gate(s) ['desync'] fire (fired: [])" in out


@pytest.mark.gate("suffix_replica")
def test_a_replica_whose_suffix_differs_is_caught(tiny_format, monkeypatch):
    from kvreplay.experiments.live_vs_prefill import live_vs_prefill_row

    lm = tiny_lm("llama")
    real, calls = decode.decode_suffix, []

    def skewed(*args, **kwargs):  # planted: the second arm (the live replica) decodes one other token
        out = real(*args, **kwargs)
        calls.append(1)
        return dataclasses.replace(out, tokens=[*out.tokens[:-1], out.tokens[-1] + 1]) if len(calls) == 2 else out

    monkeypatch.setattr(decode, "decode_suffix", skewed)
    rec = live_vs_prefill_row(RunSpec(lm=lm, fmt=tiny_format(lm), decoding=Decoding.of(TINY_CAPS)), tiny_problems(1)[0])
    assert rec["gate_failure"]["gate"] == "suffix_replica" and "live vs live_replica" in rec["gate_failure"]["reason"]
    assert "arms" not in rec


@pytest.mark.gate("argmax")
def test_a_transplant_whose_constructions_choose_another_next_token_is_caught(tiny_format):
    from kvreplay.experiments.live_vs_prefill import live_vs_prefill_row
    from kvreplay.experiments.transplant import transplant_row

    lm = tiny_lm("llama")
    fmt = tiny_format(lm)
    p = tiny_problems(1)[0]
    prefix = live_vs_prefill_row(RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS)), p)["prefix"]

    def other_argmax(states):  # planted: both prefill states (and both duplicate rows) put their maximum elsewhere
        top = decode.raw_argmax(states["incremental"].logits[0])
        for name in ("prefill", "prefill_replica"):
            logits = states[name].logits.clone()
            logits[:, (top + 1) % logits.shape[-1]] = logits.max() + 1
            states[name].logits = logits

    rec = transplant_row(RunSpec(lm=lm, fmt=fmt, decoding=Decoding.of(TINY_CAPS), faults=other_argmax), p, prefix, "exact", sweep=False)
    assert rec["gate_failure"]["gate"] == "argmax", rec["gate_failure"]
    assert "raw next-token argmax differs between constructions" in rec["gate_failure"]["reason"]



def test_each_gates_where_names_every_module_that_raises_it():
    """The registry's ``where`` (modules, ``module.function``, ``.sibling`` after a dotted module, or a package such
    as ``experiments``) names every module holding a literal raise site of the gate: it cannot drift from the code."""
    checks = {"GateError", "check_equal_sequences", "check_identical"}
    sites: dict[str, set[str]] = {}
    lib = ROOT / "lib" / "kvreplay"
    for path in sorted(lib.rglob("*.py")):
        module = ".".join(path.relative_to(lib).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
                literal = [a.value for a in node.args[:1] if name in checks and isinstance(a, ast.Constant)]
                literal += [k.value.value for k in node.keywords if k.arg == "gate" and isinstance(k.value, ast.Constant)]
                for gate in literal:
                    sites.setdefault(gate, set()).add(module)
    missing = {}
    for gate, found in sites.items():
        named, package = [], ""
        for entry in (w.strip() for w in GATES[gate].where.split(",")):
            entry = package + entry if entry.startswith(".") else entry
            package = entry.rsplit(".", 1)[0]
            named.append(entry)
        unnamed = [m for m in found if not any(m == n or n.startswith(m + ".") or m.startswith(n + ".") for n in named)]
        if unnamed:
            missing[gate] = sorted(unnamed)
    assert not missing, f"gates raised in modules their registry entry's `where` does not name: {missing}"
