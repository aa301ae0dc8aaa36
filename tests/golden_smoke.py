"""The smoke chain's computed files against the committed ones in ``tests/golden/smoke/`` (the golden rows).

Every experiment's row function runs in the smoke chain (tests/test_notebooks.py), so comparing its rows byte for
byte with committed copies catches any change of a computed bit at no extra cost. BF16 and FP32 bits depend on the
CPU kind, torch and the thread count, so the bytes are owed only where :func:`kvreplay.verify.compare_environments`
finds the chain's environment equal to the committed one; elsewhere the comparison is skipped, saying why.

Keys: a ledger's ``<experiment>-<dtype>`` (its folder name without the configuration digest, which for Experiment 5
includes the temporary checkpoint path), with the problem set appended where one experiment has several ledgers;
the fixed-prefix bank and the panels by file name.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

GOLDEN = Path(__file__).parent / "golden" / "smoke"
REWRITE = "KVREPLAY_REWRITE_GOLDEN"
"""Set to 1 to replace the committed copies with the chain's (after a deliberate change of what a row computes,
together with a new ``ROW_ALGORITHM`` and recomputed ``cpu`` ledgers)."""
SHARED = ("prefix_bank_bf16.jsonl", "exp3_bridge_panel.json", "exp4_panel.json", "exp5_panel.json")


def computed(profile_ledgers: Path) -> dict[str, Path]:
    """``{key: file}`` of a smoke run's ledger folder (``<ledger_root>/smoke``): every ledger's ``rows.jsonl``
    and the :data:`SHARED` files."""
    found: dict[str, Path] = {}
    for rows in sorted(profile_ledgers.glob("*/rows.jsonl")):
        config = json.loads((rows.parent / "manifest.json").read_text())["config"]
        key = f"{config['experiment']}-{config['dtype']}"
        if config.get("problem_set"):
            key += "-" + config["problem_set"].replace(" ", "_")
        assert key not in found, f"two smoke ledgers share the key {key}: {found[key]}, {rows}"
        found[key] = rows
    return found | {name: profile_ledgers / name for name in SHARED if (profile_ledgers / name).is_file()}


def environment(profile_ledgers: Path) -> dict:
    """The execution contract and row algorithm of the run's Experiment 1 BF16 ledger (every smoke ledger runs on
    the same CPU, torch and threads)."""
    (env,) = profile_ledgers.glob("exp1-bfloat16-*/environment.json")
    record = json.loads(env.read_text())
    return {"execution_contract": record["execution_contract"], "row_algorithm": record["row_algorithm"]}


def rewrite(profile_ledgers: Path) -> None:
    """Replace ``tests/golden/smoke`` with this run's files (see :data:`REWRITE`)."""
    shutil.rmtree(GOLDEN, ignore_errors=True)
    GOLDEN.mkdir(parents=True)
    for key, path in computed(profile_ledgers).items():
        shutil.copyfile(path, GOLDEN / (key + ".jsonl" if path.name == "rows.jsonl" else key))
    (GOLDEN / "environment.json").write_text(json.dumps(environment(profile_ledgers), indent=1, sort_keys=True) + "\n")


def differences(profile_ledgers: Path) -> tuple[str | None, list[str]]:
    """``(why the bytes are not owed here or None, what differs)``, comparing a smoke run with the golden copies.

    What differs: a missing or extra key, or for each differing file its first differing line and field
    (:func:`kvreplay.runner.batched.first_difference`)."""
    from kvreplay.runner.batched import first_difference
    from kvreplay.verify import compare_environments

    if os.environ.get(REWRITE) == "1":
        rewrite(profile_ledgers)
    committed = json.loads((GOLDEN / "environment.json").read_text())
    here = environment(profile_ledgers)
    c = compare_environments(committed["execution_contract"], here["execution_contract"])
    if c.mode != "bytes":
        return f"the golden rows were computed under another environment: {c.why}", []
    out = []
    if committed["row_algorithm"] != here["row_algorithm"]:
        out.append(f"row algorithms {committed['row_algorithm']} (golden) and {here['row_algorithm']} (now): "
                   f"rewrite the golden rows with {REWRITE}=1 once the cpu ledgers are recomputed")
    files = computed(profile_ledgers)
    golden = {p.name.removesuffix(".jsonl") if p.suffix == ".jsonl" and p.name not in SHARED else p.name: p
              for p in GOLDEN.iterdir() if p.name != "environment.json"}
    out += [f"{k}: in the golden rows, not computed" for k in sorted(golden.keys() - files.keys())]
    out += [f"{k}: computed, not in the golden rows" for k in sorted(files.keys() - golden.keys())]
    for key in sorted(files.keys() & golden.keys()):
        new, old = files[key].read_text().splitlines(), golden[key].read_text().splitlines()
        if new == old:
            continue
        if len(new) != len(old):
            out.append(f"{key}: {len(new)} lines computed, {len(old)} golden")
            continue
        i = next(i for i, (a, b) in enumerate(zip(new, old)) if a != b)
        where = first_difference(json.loads(new[i]), json.loads(old[i])) if new[i][:1] == "{" else None
        out.append(f"{key}: line {i + 1} differs" + (f" first at {where}" if where else ""))
    return None, out
