"""Role-table adaptation (kvreplay.adapt) on tiny random-weight models: sequences, masks, determinism, digests."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_FORMAT, tiny_lm, tiny_problems
from kvreplay import adapt
from kvreplay.decoding import decode
from kvreplay.decoding.contract import ANSWER, BRANCH1, MERGE, ContractError, resolve_format
from kvreplay.model.models import weights_sha256
from kvreplay.data.problems import Problem
from transformers import DynamicCache

CFG = adapt.AdaptConfig(name="test", model="tiny", fmt=TINY_FORMAT, n_train=4, n_heldout=2, steps=4, checkpoints=(2, 4),
                        eval_every=2, threads=1)


def _fmt(lm):
    return resolve_format(lm.tokenizer, TINY_FORMAT)


def _train(root, problems=None, arch="llama"):
    lms = []

    def loader():
        lms.append(tiny_lm(arch, torch.float32))
        lms.append(weights_sha256(lms[-1].model))
        return lms[0]

    folder, manifest = adapt.ensure_checkpoints(CFG, root, bank=[], loader=loader, problems=problems or tiny_problems(6),
                                                base_key={"model": f"tiny-{arch}"}, progress=False)
    return folder, manifest, lms


def test_staged_sequence_follows_the_contract():
    lm = tiny_lm("llama", torch.float32)
    fmt = _fmt(lm)
    p = tiny_problems(1)[0]
    seq = adapt.build_staged(fmt, p)
    parsed = fmt.parse(seq.ids)
    assert parsed.complete and seq.roles[0].tolist() == list(parsed.roles)
    for role in (MERGE, ANSWER):
        t = seq.targets[role]
        assert all(parsed.roles[i] == role for i in t)
        assert seq.ids[t[-1]] == fmt.closers[role][0]  # the closing token the model emits is a target
        assert t[0] == parsed.content[role][0]
    shared, letters = adapt.letter_tokens(fmt, p.letters)
    assert seq.ids[seq.letter_pos] == letters[p.answer] and seq.ids[seq.letter_pos - len(shared):seq.letter_pos] == shared
    # only the answer block depends on the gold: another gold changes nothing before the letter
    other = adapt.build_staged(fmt, dataclasses.replace(p, answer="C"))
    assert other.ids[: seq.letter_pos] == seq.ids[: seq.letter_pos] and other.ids != seq.ids
    prefix = adapt.build_staged(fmt, p, with_answer=False)
    assert prefix.ids == seq.ids[: seq.letter_pos] and prefix.targets[ANSWER] == []
    assert adapt.block_texts(p)[BRANCH1].startswith("Option A: x")


def test_training_forward_uses_the_decoders_inputs():
    """The training/metric forward and the decoders' forward see the same roles, mask and positions."""
    lm = tiny_lm("qwen2", torch.float32)
    g = torch.Generator().manual_seed(1)
    lm.role_table = torch.randn(14, lm.model.config.hidden_size, generator=g)
    fmt = _fmt(lm)
    seq = adapt.build_staged(fmt, tiny_problems(1)[0], with_answer=False)
    mine = adapt.training._call(lm, seq, None, torch.tensor([len(seq.ids) - 1]))[0]
    ids = torch.tensor(seq.ids).unsqueeze(0).expand(2, -1).contiguous()
    roles = seq.roles.expand(2, -1).contiguous()
    with torch.inference_mode():
        theirs = decode.forward(lm, DynamicCache(config=lm.model.config), ids, roles, 0)[0]
    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    # an explicit table overrides lm.role_table, and a zero table equals no table at all
    zero = torch.zeros_like(lm.role_table)
    lm.role_table = None
    a = adapt.training._call(lm, seq, zero, torch.tensor([len(seq.ids) - 1]))
    b = adapt.training._call(lm, seq, None, torch.tensor([len(seq.ids) - 1]))
    assert torch.equal(a, b)


def test_training_is_deterministic_and_touches_only_role_rows(tmp_path):
    f1, m1, lms = _train(tmp_path / "a")
    f2, m2, _ = _train(tmp_path / "b")
    assert f1.name == f2.name and f1.name.startswith("role-table-test-")
    for name in ("manifest.json", "environment.json", "role_table_step0002.pt", "role_table_step0004.pt"):
        assert (f1 / name).read_bytes() == (f2 / name).read_bytes(), name
    lm, before = lms[0], lms[1]
    assert weights_sha256(lm.model) == before == m1["base_model"]["weights_sha256_float32"]
    early = torch.load(f1 / "role_table_step0002.pt", weights_only=True)
    later = torch.load(f1 / "role_table_step0004.pt", weights_only=True)
    assert early.shape == later.shape == (14, lm.model.config.hidden_size) and early.dtype == torch.float32
    assert not later[:8].any() and later[8:].abs().sum(dim=1).gt(0).all()
    assert not torch.equal(early, later)
    curve = m1["curve"]
    assert [r["step"] for r in curve["train"]] == [1, 2, 3, 4]
    assert [r["step"] for r in curve["heldout"]] == [0, 2, 4]
    assert set(m1["checkpoints"]) == {"early", "later"} and m1["config"]["trainable_rows"] == list(range(8, 14))


def test_finished_folder_is_reused_and_a_changed_file_is_refused(tmp_path):
    folder, manifest, _ = _train(tmp_path)

    def no_load():
        raise AssertionError("a finished checkpoint folder must not load the model")

    again, m2 = adapt.ensure_checkpoints(CFG, tmp_path, bank=[], loader=no_load, problems=tiny_problems(6),
                                         base_key={"model": "tiny-llama"}, progress=False)
    assert again == folder and m2 == manifest
    ck = adapt.checkpoint(folder, "later")
    assert ck.step == 4 and ck.sha256 == manifest["checkpoints"]["later"]["sha256"]
    t = torch.load(ck.path, weights_only=True)
    t[9, 0] += 1.0
    torch.save(t, ck.path)
    with pytest.raises(adapt.CheckpointError, match="sha256"):
        adapt.checkpoint(folder, "later")
    with pytest.raises(adapt.CheckpointError, match="sha256"):
        adapt.ensure_checkpoints(CFG, tmp_path, bank=[], loader=no_load, problems=tiny_problems(6),
                                 base_key={"model": "tiny-llama"}, progress=False)
    with pytest.raises(adapt.CheckpointError, match="no checkpoint 'middle'"):
        adapt.checkpoint(folder, "middle")
    with pytest.raises(adapt.CheckpointError, match="00_role_adaptation"):
        adapt.checkpoint(tmp_path / "nowhere")


def test_training_data_must_be_disjoint_from_the_bank():
    probs = tiny_problems(4)
    adapt.assert_disjoint(probs[:2], probs[2:])
    clash = Problem(problem_id="other-0001", source="test", source_line=9, question=probs[3].question.upper(),
                    options=("a", "b", "c", "d"), answer="A")
    with pytest.raises(ValueError, match="overlaps"):
        adapt.assert_disjoint([clash], probs[2:])
    six = tiny_problems(6)
    with pytest.raises(ValueError, match="overlaps"):  # checked before anything is loaded or written
        adapt.ensure_checkpoints(CFG, "/nonexistent", bank=six[:1], problems=six, base_key={"model": "x"},
                                 loader=lambda: None, progress=False)


def test_openbookqa_split_is_outcome_blind_and_disjoint_from_the_mmlu_bank():
    from kvreplay.data.problems import load_bank

    rows, sha = adapt.load_source("openbookqa")
    assert len(rows) == 500 and len(sha) == 64
    adapt.assert_disjoint(rows, load_bank())
    train, held = adapt.split_problems(rows, 64, 16)
    assert len(train) == 64 and len(held) == 16 and not {p.problem_id for p in train} & {p.problem_id for p in held}
    flipped = [dataclasses.replace(p, answer="A" if p.answer != "A" else "B") for p in reversed(rows)]
    t2, h2 = adapt.split_problems(flipped, 64, 16)  # answers and input order cannot change the split
    assert [p.problem_id for p in t2] == [p.problem_id for p in train] and [p.problem_id for p in h2] == [p.problem_id for p in held]


def test_letter_eval_ledger_resumes_and_summarizes(tmp_path):
    folder, manifest, _ = _train(tmp_path / "ck")
    later = adapt.checkpoint(folder, "later")
    probs = tiny_problems(3)
    calls = []

    def loader():
        calls.append(1)
        return tiny_lm("llama", torch.float32)

    kw = dict(model="tiny", fmt=TINY_FORMAT, profile="t", ledger_root=tmp_path / "ledger", threads=1, progress=False,
              loader=loader, base_key={"model": "tiny-llama"})
    tables = {"ckpt0": (None, None), "later": (str(later.path), later.sha256)}
    recs, ledger = adapt.run_letter_eval(probs, tables, **kw)
    assert len(calls) == 1 and [r["problem_id"] for r in recs] == [p.problem_id for p in probs]
    assert set(recs[0]["checkpoints"]) == {"ckpt0", "later"} and set(recs[0]["checkpoints"]["later"]["logits"]) == set("ABCD")
    again, _ = adapt.run_letter_eval(probs, tables, **kw)
    assert again == recs and len(calls) == 1  # reused without loading
    s = adapt.accuracy_summary(recs, n_resamples=200)
    assert s["n"] == 3 and s["acc_a"].n == 3 and s["mcnemar"].b + s["mcnemar"].c <= 3
    table = adapt.accuracy_table(s, {"ckpt0": "checkpoint 0", "later": "later"})
    assert table.iloc[:, 0]["problems"] == "3"


def test_letter_tokens_refuses_an_ambiguous_tokenizer():
    lm = tiny_lm("llama", torch.float32)
    fmt = _fmt(lm)
    shared, letters = adapt.letter_tokens(fmt)
    assert len(set(letters.values())) == 4
    with pytest.raises(ContractError):
        adapt.letter_tokens(fmt, ["A", "AB"])


def test_load_checkpoint_model_checks_the_table_and_the_base(tmp_path, monkeypatch):
    import kvreplay.model.models as models

    folder, manifest, _ = _train(tmp_path)
    later = adapt.checkpoint(folder, "later")
    loaded = {}

    def fake_load(model, dtype, role_table=None, sdpa_backends=("math",), **kw):
        loaded.update(model=model, dtype=dtype, role_table=role_table)
        return dataclasses.replace(tiny_lm("llama", torch.float32), identity={"role_table_sha256": models.file_sha256(role_table)})

    monkeypatch.setattr(adapt.checkpoints, "load_model", fake_load)  # the module binds load_model at import
    lm = adapt.load_checkpoint_model(folder, "later", "bfloat16")
    assert loaded == {"model": "tiny", "dtype": "bfloat16", "role_table": later.path}
    assert lm.identity["role_table_sha256"] == later.sha256
    with pytest.raises(adapt.CheckpointError, match="not the base"):
        adapt.load_checkpoint_model(folder, "later", model="embedded")  # the table was keyed to another base model
    torch.save(torch.zeros(14, 64), later.path)
    with pytest.raises(adapt.CheckpointError, match="sha256"):
        adapt.load_checkpoint_model(folder, "later")
