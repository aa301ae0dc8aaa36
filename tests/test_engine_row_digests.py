"""Every arm's rows from the batched engine on a tiny random-weight Llama on the CPU, pinned by digest.

A refactor of the engine, the decoders or how settings reach them must leave each row's bits and each ledger key as
they were: the sha256 of every arm's rows (canonical JSON, in ledger order) and its ledger folder's name are
compared with :data:`RECORDED` and :data:`FOLDERS`, recorded before such a refactor (``KV_RECORD_DIGESTS=1`` prints
them). The folder names are compared everywhere; the rows' digests where torch and the CPU's kernels are those of a
recorded table (BF16 bits depend on them), FP32 rows included (their reductions may too).
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
import yaml
from conftest import TINY_CAPS, TINY_FORMAT, make_model, make_tokenizer

from kvreplay.experiments.arms import ARMS
from kvreplay.ledger.store import canonical_json
from kvreplay.model.models import cpu_isa_flags
from kvreplay.data.problems import Problem
from kvreplay.runner import ArmSettings

PROBLEMS = [Problem(f"p-{i:02d}", "test", i + 1, "Q" + "xyz"[i % 3] * (3 * i) + "?", ("x", "y", f"z{i}", "w"),
                    "ABCD"[i % 4]) for i in range(4)]
BATCHED = dict(step_path="engine-eager", batch=2)
VOLATILE = ("seconds", "wall_s", "elapsed_s", "compute_s")
"""Row keys that hold a time (none of the row algorithms writes one today; left out if one ever does)."""

FOLDERS = {
    "exp1-bfloat16": "exp1-bfloat16-913131bea031",
    "exp1-float32": "exp1-float32-28c43aca1cd7",
    "exp1_ties-bfloat16": "exp1_ties-bfloat16-3f86f36f68f8",
    "exp2-bfloat16": "exp2-bfloat16-4fa2a11bce3f",
    "exp2-float32": "exp2-float32-2747ab5b16a1",
    "exp2_controls-bfloat16": "exp2_controls-bfloat16-96ba04df3158",
    "exp3-bfloat16": "exp3-bfloat16-f302fdd7a101",
    "exp4-bfloat16": "exp4-bfloat16-96e62f29c0c0",
    "exp5-bfloat16": "exp5-bfloat16-98feee1f88b7",
}
"""``<experiment>-<dtype>`` -> its ledger folder's name (compared on every machine)."""

RECORDED = [
    (("2.13.0+cpu", "AVX512", ["avx512_bf16", "avx512f", "avx2"]), {  # an AMD EPYC
        "exp1-bfloat16": "88044995b75483ec3b15f379f36f98129f75e88d809e877693537eae6979cd30",
        "exp1-float32": "58b98322c20a36c70eb75e0d35d18abc207b6d6bc4e5dcdb5a2e6257178f50ee",
        "exp1_ties-bfloat16": "485ed68f67af5230bcc97899c192f1773409a90d884fa6ff76e46b04f522a232",
        "exp2-bfloat16": "97647fc19c44e018f41c11db4c2bb822d64f417f0a9271f5a1d92f00423492b7",
        "exp2-float32": "bf7aebd0db66e59ebc8d55b2be3227cf9f4ef5c0cae45b10217636fd1a10f845",
        "exp2_controls-bfloat16": "725e11817ce89a21a2e9632080c068ad27d38a5874516e40fd5b5e8a524f8d2e",
        "exp3-bfloat16": "a49579086846548a40be5371c3a3ca4cfb567b05e68ec5e643543de296f8cd07",
        "exp4-bfloat16": "97560ea5acd3ea39678beaba5b5e31e428debeb8d17af1bb74b04efd608e175e",
        "exp5-bfloat16": "e9081761ea27985be32f9bd8e9dcc83253bc1a1dcf85e7e5fcc33d08525fde7e",
    }),
    (("2.13.0+cpu", "AVX512", ["amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"]), {  # an Intel Xeon with AMX
        "exp1-bfloat16": "66327cb65c5fd2981275aa4521e946954270b7065e53100711670c9913a0c89d",
        "exp1-float32": "6dc145112f4ae4134bba0a5708ee2ea6bbf06ae004cf29b6404f7d885718ae37",
        "exp1_ties-bfloat16": "a39a6f49d07638f30a8abc2021f367465224633970898e7b299bd371fa79cfe0",
        "exp2-bfloat16": "5dc3fa88ee4aeba97eb5ecfd3abf48fd14c750ecd32fcb9c4585bab21c3c4b05",
        "exp2-float32": "89c47d80e3eaa9a01d8ae1daeb6a8a3f2c436067edae6a7492e43fb0ae658530",
        "exp2_controls-bfloat16": "a89d4556b10e91bc1b301f1e469890dee0496caddcffacb79a687bf83b5f99ae",
        "exp3-bfloat16": "00184f5c01d52a4bf9835d22c5cfbfacbfd109023c5d3ad0cdb535ab66110ab9",
        "exp4-bfloat16": "859dea889fcc09eb84a2736b9f71b9afd6e9f1b97b0b52cf4d433ee8c674b46e",
        "exp5-bfloat16": "69628887d3fec10d80772820152cbf7f13014a43dc3c8d1066eb183afa1e439c",
    }),
]
"""(torch's version, its CPU capability, the BF16-relevant CPU flags) -> ``<experiment>-<dtype>`` -> sha256 of its
rows: each table recorded on such a machine before a refactor, the AMX one at commit 770da6a."""


def _digest(rows: list[dict]) -> str:
    clean = [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]
    return hashlib.sha256("\n".join(canonical_json(r) for r in clean).encode()).hexdigest()


@pytest.fixture(scope="module")
def computed(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tok = make_tokenizer()
    make_model("llama", len(tok)).save_pretrained(root / "tiny-llama")
    tok.save_pretrained(root / "tiny-llama")
    (root / "tiny.yaml").write_text(yaml.safe_dump(TINY_FORMAT))

    def settings(dtype: str) -> ArmSettings:
        return ArmSettings(profile="t", dtype=dtype, caps=TINY_CAPS, model=str(root / "tiny-llama"), fmt=str(root / "tiny.yaml"), threads=1,
                           preflight=1, **BATCHED)

    ledgers = root / "ledgers"
    out: dict[str, tuple[str, str]] = {}
    records, ledger = ARMS["exp1"].run(settings("bfloat16"), PROBLEMS, ledger_root=ledgers, progress=False)
    out["exp1-bfloat16"] = (_digest(records), ledger.dir.name)
    prefixes = {r["problem_id"]: r["prefix"] for r in records}
    records, ledger = ARMS["exp1"].run(settings("float32"), PROBLEMS, ledger_root=ledgers, progress=False)
    out["exp1-float32"] = (_digest(records), ledger.dir.name)
    records, ledger = ARMS["exp1_ties"].run(settings("bfloat16"), PROBLEMS, ledger_root=ledgers, progress=False,
                                            key={"tie_rule": "highest", "top_logits": True})
    out["exp1_ties-bfloat16"] = (_digest(records), ledger.dir.name)
    bank = {"prefix_bank_sha256": "bank"}
    panel = [{"problem_id": p.problem_id, "stratum": "divergent" if i % 2 else "exact",
              "prefix_len": len(prefixes[p.problem_id])} for i, p in enumerate(PROBLEMS)]
    keys = {"exp2": bank, "exp2_controls": bank | {"seed": 7},
            "exp3": bank, "exp4": bank | {"panel": panel, "sweep": [PROBLEMS[1].problem_id]},
            "exp5": bank | {"panel": panel, "checkpoint": {"name": "tiny"}}}
    for name, key in keys.items():
        for dtype in ARMS[name].dtypes:
            records, ledger = ARMS[name].run(settings(dtype), PROBLEMS, ledger_root=ledgers, progress=False,
                                             prefixes=prefixes, key=key)
            out[f"{name}-{dtype}"] = (_digest(records), ledger.dir.name)
    return out


def test_engine_rows_and_ledger_keys_are_those_recorded(computed):
    if os.environ.get("KV_RECORD_DIGESTS"):
        print(json.dumps(computed, indent=1))
    assert set(computed) == set(FOLDERS)
    keys = {k: (computed[k][1], FOLDERS[k]) for k in FOLDERS if computed[k][1] != FOLDERS[k]}
    assert not keys, f"ledger keys differ from the recorded ones (computed, recorded): {keys}"
    here = (torch.__version__, torch.backends.cpu.get_cpu_capability(), cpu_isa_flags())
    digests = next((d for kernels, d in RECORDED if kernels == here), None)
    if digests is None:
        pytest.skip(f"ledger keys equal; rows not compared: no digests recorded under kernels {here} "
                    f"(recorded: {[kernels for kernels, _ in RECORDED]})")
    assert set(digests) == set(FOLDERS)
    rows = {k: (computed[k][0], digests[k]) for k in digests if computed[k][0] != digests[k]}
    assert not rows, f"rows differ from the recorded ones (computed, recorded): {rows}"
