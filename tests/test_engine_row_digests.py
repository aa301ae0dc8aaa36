"""Every arm's rows from the batched engine on a tiny random-weight Llama on the CPU, pinned by digest.

A refactor of the engine, the decoders or how settings reach them must leave each row's bits and each ledger key as
they were: the sha256 of every arm's rows (canonical JSON, in ledger order) and its ledger folder's name are
compared with :data:`DIGESTS`, recorded before such a refactor (``KV_RECORD_DIGESTS=1`` prints the table). The
folder names are compared everywhere; the rows' digests where torch and the CPU's kernels are those that recorded
them (:data:`KERNELS`: BF16 bits depend on them), FP32 rows included (their reductions may too).
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

DIGESTS = {
    "exp1-bfloat16": ("88044995b75483ec3b15f379f36f98129f75e88d809e877693537eae6979cd30",
                     "exp1-bfloat16-913131bea031"),
    "exp1-float32": ("58b98322c20a36c70eb75e0d35d18abc207b6d6bc4e5dcdb5a2e6257178f50ee",
                    "exp1-float32-28c43aca1cd7"),
    "exp1_ties-bfloat16": ("485ed68f67af5230bcc97899c192f1773409a90d884fa6ff76e46b04f522a232",
                          "exp1_ties-bfloat16-3f86f36f68f8"),
    "exp2-bfloat16": ("97647fc19c44e018f41c11db4c2bb822d64f417f0a9271f5a1d92f00423492b7",
                     "exp2-bfloat16-4fa2a11bce3f"),
    "exp2-float32": ("bf7aebd0db66e59ebc8d55b2be3227cf9f4ef5c0cae45b10217636fd1a10f845",
                    "exp2-float32-2747ab5b16a1"),
    "exp2_controls-bfloat16": ("725e11817ce89a21a2e9632080c068ad27d38a5874516e40fd5b5e8a524f8d2e",
                              "exp2_controls-bfloat16-96ba04df3158"),
    "exp3-bfloat16": ("a49579086846548a40be5371c3a3ca4cfb567b05e68ec5e643543de296f8cd07",
                     "exp3-bfloat16-f302fdd7a101"),
    "exp4-bfloat16": ("97560ea5acd3ea39678beaba5b5e31e428debeb8d17af1bb74b04efd608e175e",
                     "exp4-bfloat16-96e62f29c0c0"),
    "exp5-bfloat16": ("e9081761ea27985be32f9bd8e9dcc83253bc1a1dcf85e7e5fcc33d08525fde7e",
                     "exp5-bfloat16-98feee1f88b7"),
}
"""``<experiment>-<dtype>`` -> (sha256 of its rows, its ledger folder's name), recorded under :data:`KERNELS`."""
KERNELS = ("2.13.0+cpu", "AVX512", ["avx512_bf16", "avx512f", "avx2"])
"""torch's version, its CPU capability and the BF16-relevant CPU flags where :data:`DIGESTS` were recorded."""


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
    assert set(computed) == set(DIGESTS)
    keys = {k: (computed[k][1], DIGESTS[k][1]) for k in DIGESTS if computed[k][1] != DIGESTS[k][1]}
    assert not keys, f"ledger keys differ from the recorded ones (computed, recorded): {keys}"
    here = (torch.__version__, torch.backends.cpu.get_cpu_capability(), cpu_isa_flags())
    if here != KERNELS:
        pytest.skip(f"ledger keys equal; rows not compared: kernels {here} are not those that recorded them {KERNELS}")
    rows = {k: (computed[k][0], DIGESTS[k][0]) for k in DIGESTS if computed[k][0] != DIGESTS[k][0]}
    assert not rows, f"rows differ from the recorded ones (computed, recorded): {rows}"
