"""The engine reports what it measured one way: returned by the call that ran it, never through shared counters.

Each engine counts its steps, slot-steps, verified steps and attention checks in its own
:class:`kvreplay.engine.EngineStats`; a batched decoder returns them with its results (:class:`kvreplay.engine.Measured`).
Two calls do not see each other's steps, the settings object holds no statistics, and no module of
``kvreplay.engine`` keeps state of its own that a step changes.
"""

from __future__ import annotations

import ast
import dataclasses
import json

import pytest
import torch
from conftest import TINY_CAPS, TINY_FORMAT, tiny_lm

from kvreplay import engine
from kvreplay.decoding.contract import Caps, resolve_format
from kvreplay.decoding.settings import Decoding
from kvreplay.engine import EngineRun, EngineStats, Measured, engine_max_len
from kvreplay.paths import ROOT


def _module_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_no_engine_module_keeps_state_that_a_step_changes():
    """No ``global``, and no write into a module-level name (item, attribute or a mutating method) in a function."""
    mutating = {"append", "extend", "update", "clear", "pop", "add", "insert", "setdefault", "remove"}
    found = []
    for path in sorted((ROOT / "lib" / "kvreplay" / "engine").glob("*.py")):
        tree = ast.parse(path.read_text())
        names = _module_names(tree)
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                target = None
                if isinstance(node, ast.Global):
                    found.append(f"{path.name}:{node.lineno}: global {node.names}")
                elif isinstance(node, (ast.AugAssign, ast.Assign)):
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                        if isinstance(t, (ast.Subscript, ast.Attribute)) and isinstance(t.value, ast.Name):
                            target = t.value.id
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in mutating and isinstance(node.func.value, ast.Name):
                    target = node.func.value.id
                if target in names:
                    found.append(f"{path.name}:{node.lineno}: writes module-level {target}")
    assert not found, found


def test_each_decoder_returns_what_its_own_engine_measured():
    lm = tiny_lm(dtype=torch.float32)
    fmt = resolve_format(lm.tokenizer, TINY_FORMAT)
    prompts = [fmt.prompt_ids("Q" + "x" * i + "?", ("a", "b", "c", "d")) for i in range(3)]
    a = engine.decode_lives(lm, fmt, prompts, TINY_CAPS, run=EngineRun(batch=2))
    assert isinstance(a, Measured) and a.stats.steps > 0 and a.stats.slot_steps == 2 * a.stats.steps
    lives = engine.decode_lives(lm, fmt, prompts, TINY_CAPS, run=EngineRun(batch=3))
    b = lives.stats
    assert b.slot_steps == 3 * b.steps and 0 < b.busy_slot_steps <= b.slot_steps
    steps_a, steps_b = a.stats.steps, b.steps
    suffixes = engine.decode_suffixes(lm, fmt, lives, TINY_CAPS, run=EngineRun(batch=3))  # another call, its own engine
    assert a.stats.steps == steps_a and b.steps == steps_b and suffixes.stats.steps > 0
    total = b + suffixes.stats
    assert total.steps == b.steps + suffixes.stats.steps and b.steps == steps_b  # a sum is a new object
    assert engine.decode_suffixes(lm, fmt, [], TINY_CAPS).stats == EngineStats()
    event = b.chunk_event(3, 1.23456)
    assert list(event) == ["problems", "seconds", "steps", "slot_steps", "busy_slot_steps", "occupancy",
                           "kv_positions", "capture_s"]
    # every busy slot-step attends to at least one key position and at most max_len of them
    assert b.busy_slot_steps <= event["kv_positions"] and event["capture_s"] == 0.0  # eager: no graph captured
    assert event["seconds"] == 1.235 and event["occupancy"] == round(b.busy_slot_steps / b.slot_steps, 4)
    run = EngineRun(batch=2)
    logged = run.settings(Decoding.of(Caps(1, 1, 1), "hash:3"))
    assert "stats" not in {f.name for f in dataclasses.fields(EngineRun)}
    assert json.dumps(logged) == (  # the run log's engine entry, byte for byte as before EngineRun lost the rule
        '{"step_path": "eager", "batch": 2, "max_len": null, "verify_steps": 0, "chunk": null, "attention": "sdpa", '
        '"tolerance_check": false, "fill_from": "first", "tie_rule": "hash:3", "top_logits": false}')


def test_flex_max_len_is_rounded_in_one_place():
    assert engine_max_len(129, "flex") == 256 and engine_max_len(128, "flex") == 128
    assert engine_max_len(129, "sdpa") == 129 == EngineRun().max_len_for(129)
    assert EngineRun(attention="flex").max_len_for(129) == 256
    with pytest.raises(ValueError, match="max_len=100 is shorter than the 129 positions"):
        EngineRun(max_len=100).max_len_for(129)
