"""The README's headline block and ``docs/results-<profile>.md``, rendered from a profile's results as data.

The numbers come from :func:`kvreplay.report.results.profile_results` (the
experiments' summary functions over the committed ledgers) and the paper's
from ``data/paper/reference.yaml``'s ``value`` entries; nothing is read back
from a formatted table or from prose, so renaming a table's row label changes
nothing here. ``make paper PROFILE=<p>`` calls :func:`regenerate`::

    python -m kvreplay.report.results_pages --profile paper          # rewrite the page (and the README block)
    python -m kvreplay.report.results_pages --profile paper --check  # change nothing; exit 1 naming what differs

Only the block between the README's ``results-headline`` markers is ever
rewritten, and only for :data:`HEADLINE_PROFILE`. The page of a profile that ends a
:data:`~kvreplay.report.cross_family.FAMILY_PAIRS` pair ends with the other model family's profile beside it.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from ..experiments.transplant import RULE_TEXT, reported_ways
from ..ledger.lookup import MissingLedgerError
from ..paths import LEDGERS, ROOT
from ..analysis.stats import Proportion, wilson
from .cross_family import Families, families_section, family_results
from .markdown import caps_text as _caps, dtype_label as _dtype, pct as _pct, pts, pval, rate, table  # re-exported
from .results import ProfileResults, profile_results, profile_stats
from .summary import checkpoint_recipe, recipe_note

HEADLINE_PROFILE = "paper"
"""The profile whose results the README's headline table shows (the paper's caps and row count)."""
TOOL = "python -m kvreplay.report.results_pages"
BEGIN = ("<!-- results-headline: {profile} (generated from data/ledgers/{profile}/ and data/paper/reference.yaml "
         "by `make paper PROFILE={profile}`; do not edit) -->")
END = "<!-- /results-headline -->"
BLOCK = re.compile(r"<!-- results-headline: (?P<profile>[\w.-]+) .*?-->\n.*?<!-- /results-headline -->", re.S)


def page_path(profile: str, root: Path = ROOT) -> Path:
    """``<root>/docs/results-<profile>.md``."""
    return Path(root) / "docs" / f"results-{profile}.md"


# ----------------------------------------------------------------------------- formatting


def paper_rate(res: ProfileResults, endpoint_id: str) -> str:
    """The paper's count of an endpoint with its Wilson interval, from ``reference.yaml``'s ``value``."""
    v = res.paper(endpoint_id)
    return rate(wilson(v["k"], v["n"]))


def inside(ours: Proportion | None, paper: dict) -> str:
    """``yes`` when the paper's rate ``k/n`` lies inside our Wilson 95% interval, else ``no``."""
    if ours is None:
        return "—"
    return "yes" if ours.low <= paper["k"] / paper["n"] <= ours.high else "no"


def _path(step_path: str, batch: int | None, attention: str) -> str:
    if step_path == "eager":
        return "the eager reference decoders (`step_path: eager`, one problem at a time)"
    what = "CUDA-graph step" if step_path == "graph" else "op-by-op step"
    return f"the batched engine's {what} (`step_path: {step_path}`, {batch} problems per step, attention `{attention}`)"


def where_text(res: ProfileResults) -> str:
    """One sentence: how many ledgers, at which caps, on which device and decode path (from the environment records)."""
    parts = []
    for s in res.setups:
        whose = f"the {len(s.ledgers)} ledgers read here" if len(res.setups) == 1 else ", ".join(f"`{k}`" for k in s.ledgers)
        parts.append(f"{whose} on {s.device} through {_path(s.step_path, s.batch, s.attention)}, SDPA backend "
                     f"`{'/'.join(s.sdpa_backends)}`, {s.threads} threads, torch {s.torch}")
    return (f"{res.problems} {res.dataset} problems at caps {_caps(res.caps)} (branch / merge / answer), "
            f"{', '.join(_dtype(d) for d in res.precisions)}; " + "; ".join(parts) + ".")


def gates_text(res: ProfileResults) -> str:
    """Which rows failed a gate (a panel row that failed the transplant's precondition is named), or that none did."""
    rows = sum(len(v.records) for v in res.ledgers.values())
    failed = sum(res.gate_failures.values())
    text = (f"Every gate passed on all {rows:,} rows." if not failed else
            f"Every gate passed on {rows - failed:,} of {rows:,} rows.")
    for name, s in (("Experiment 4", res.summary["transplant"]), ("Experiment 5", res.summary["replication"])):
        how = RULE_TEXT[s["precondition_failures"]] if name == "Experiment 4" else f"is left out of every {name} endpoint"
        for r in s["ineligible"]:
            text += (f" {name} panel row `{r['problem_id']}` ({r['stratum']} stratum) failed the transplant's registered "
                     f"precondition: {how} "
                     f"([why](differences.md#the-transplant-precondition)); its ledger row records: {r['reason']}.")
    return text


# ----------------------------------------------------------------------------- the README headline


def headline_rows(res: ProfileResults) -> list[tuple[str, str, str, str, str]]:
    """``(short name, endpoint, here, the paper, the paper's rate inside our interval)`` for the README's headline."""
    S = res.summary
    rows: list[tuple[str, str, str, str, str]] = []
    for exp, ref, sec in (("exp1", "live", "§4.1"), ("exp2", "incremental", "§4.2")):
        s, x = S[exp], exp[-1]
        if "bfloat16" in s:
            b, pid = s["bfloat16"], f"{exp}.bf16.suffix"
            where = " (fixed prefixes)" if exp == "exp2" else ""
            rows.append((f"Exp {x} BF16 rate", f"{sec} Exp {x}, BF16: suffixes part, prefill vs {ref}{where}",
                         rate(b["suffix"]), paper_rate(res, pid), inside(b["suffix"], res.paper(pid))))
            rows.append(("", f"{sec} Exp {x}, BF16: of those, begun at an exact top-1/top-2 logit tie",
                         f"{b['tie_initiated']} of {b['suffix'].k}", "not reported", "—"))
        if "float32" in s:
            fid = "exp1.fp32.decoded" if exp == "exp1" else "exp2.fp32.suffix"
            rows.append((f"Exp {x} FP32", f"{sec} Exp {x}, FP32: suffixes part", rate(s["float32"]["suffix"]),
                         paper_rate(res, fid), inside(s["float32"]["suffix"], res.paper(fid))))
    cross = S["crossing"]
    if cross:
        m = cross["suffix"]["mcnemar"]
        rows.append(("", "§4.2 Exp 2: BF16 against FP32 on the same problems, exact McNemar",
                     f"{m.b} vs {m.c}, p = {pval(m.pvalue)}", f"p = {res.paper('exp2.reduction.suffix')['p']:.3g}", "—"))
    b = S["bridge"]
    keys = ("layers_exact", "logits_exact", "suffix_exact")
    ours = [wilson(b[k], b["n"]) for k in keys]
    theirs = [res.paper(f"exp3.bridge.{k}") for k in keys]
    rows.append(("Exp 3 bridge", "§4.3 Exp 3: incremental rebuild = live, bit for bit: cache (every layer) / logits / suffix",
                 " / ".join(f"{p.k}/{p.n}" for p in ours), " / ".join(f"{v['k']}/{v['n']}" for v in theirs),
                 "yes" if all(inside(p, v) == "yes" for p, v in zip(ours, theirs)) else "no"))
    t = S["transplant"]
    for short, label, key, pid in (
            ("Exp 4 transplant", "§4.4 Exp 4: whole-cache transplant, suffix follows the donor both ways (integrity check)",
             "joint_recovery", "exp4.joint_recovery"),
            ("Exp 4 exact controls", "§4.4 Exp 4: third trajectory among exact controls", "third_among_exact",
             "exp4.third_among_exact")):
        for tag, ours_p in _precondition_ways(t, t[key], t["counted_as_failure"][key]):
            rows.append((short + tag, label + tag, rate(ours_p), paper_rate(res, pid), inside(ours_p, res.paper(pid))))
    r = S["replication"]
    rows.append(("Exp 5 rate", f"§4.5 Exp 5 (later checkpoint{recipe_note(res.ledgers.get('exp5-bfloat16'))}): suffixes part, prefill vs incremental",
                 rate(r["divergence"]),
                 paper_rate(res, "exp5.divergence"), inside(r["divergence"], res.paper("exp5.divergence"))))
    both = [inside(r["joint_recovery"], res.paper("exp5.joint_recovery")),
            inside(r["third_among_exact"], res.paper("exp5.third_among_exact"))]
    rows.append(("Exp 5 transplant and controls", "§4.5 Exp 5: donor recovery both ways; new trajectory among exact controls",
                 f"{rate(r['joint_recovery'])}; {rate(r['third_among_exact'])}",
                 f"{paper_rate(res, 'exp5.joint_recovery')}; {paper_rate(res, 'exp5.third_among_exact')}",
                 "yes" if both == ["yes", "yes"] else "no"))
    i = r["interpretation"]
    paper_label = res.paper_text("exp5.interpretation")
    rows.append(("Exp 5 verdict", f"§4.5 Exp 5: frozen interpretation (at least {i.min_divergent} divergent, "
                 f"{i.min_exact} exact rows)", i.label, paper_label, "same" if i.label == paper_label else "no: another label"))
    return rows


def headline_block(res: ProfileResults) -> str:
    """The README's headline block (markers included): ours against the paper's, with Wilson intervals."""
    rows = headline_rows(res)
    body = table(["endpoint (paper section)", f"here (`{res.profile}` profile)", "the paper",
                  "the paper's rate inside our 95% interval"], [r[1:] for r in rows])
    yes = [r[0] for r in rows if r[0] and r[4] in ("yes", "same")]
    no = [r[0] for r in rows if r[0] and r[4].startswith("no")]
    lines = [
        BEGIN.format(profile=res.profile), "",
        body, "",
        f"Counts are problems (rows); brackets hold Wilson 95% intervals in percent. Computed from {where_text(res)} "
        + gates_text(res).replace("](differences.md", "](docs/differences.md"), "",
        f"The paper's value lies inside our interval for {', '.join(yes) or 'none'}; outside it, or another label, "
        f"for {', '.join(no) or 'none'}. "
        f"Every table of this profile: [docs/results-{res.profile}.md](docs/results-{res.profile}.md).",
        "", END,
    ]
    return "\n".join(lines)


def replace_block(readme: str, block: str, profile: str) -> str:
    """README text with the ``results-headline`` block of ``profile`` replaced by ``block``.

    Raises:
        ValueError: the README has no such block (add the two marker lines where it should go).
    """
    found = [m for m in BLOCK.finditer(readme) if m["profile"] == profile]
    if len(found) != 1:
        raise ValueError(f"README.md has {len(found)} results-headline blocks of profile {profile!r}; it needs one: "
                         f"a line {BEGIN.format(profile=profile)!r}, then {END!r}")
    m = found[0]
    return readme[:m.start()] + block + readme[m.end():]


# ----------------------------------------------------------------------------- the results page


def _matrix_rows(res: ProfileResults, exp: str) -> list[list[str]]:
    """Experiment 1 or 2 endpoints per precision, and the paper's (both precisions in one cell)."""
    S = res.summary[exp]
    ref = "live" if exp == "exp1" else "incremental"
    d = list(S)
    cross = res.summary["exp1_cross"] if exp == "exp1" else (
        (res.summary["crossing"]["prefix_identical"], res.summary["crossing"]["n"]) if res.summary["crossing"] else None)
    P = res.paper_text
    fp = "exp1.fp32.decoded" if exp == "exp1" else "exp2.fp32.suffix"
    paper = {
        "replicas": P(f"{exp}.replicas_exact"),
        "boundary": P("exp1.bf16.boundary_non_exact") if exp == "exp1" else "not reported",
        "first": P("exp1.bf16.first_token_agree") if exp == "exp1" else "not reported",
        "suffix": f"BF16 {paper_rate(res, f'{exp}.bf16.suffix')}; FP32 {paper_rate(res, fp)}",
        "answer": f"BF16 {P(f'{exp}.bf16.answer')}" + ("; FP32 " + P("exp2.fp32.answer") if exp == "exp2" else ""),
        "label": f"BF16 {P(f'{exp}.bf16.label')}" + ("; FP32 " + P("exp2.fp32.label") if exp == "exp2" else ""),
        "firstdiv": P("exp1.bf16.first_divergence") if exp == "exp1" else "not reported",
        "accuracy": f"BF16 {P('exp1.bf16.accuracy')}" if exp == "exp1" else P("exp2.accuracy"),
        "diff": f"BF16 {P('exp1.bf16.accuracy_diff')}" if exp == "exp1" else "not reported",
        "mcnemar": f"BF16 {P('exp1.bf16.mcnemar')}" if exp == "exp1" else "not reported",
        "drift": P("exp2.drift") if exp == "exp2" else "not reported",
        "cross": P("exp1.cross_precision_prefix") if exp == "exp1" else P("exp2.prefix_identical"),
        "prefix": P("exp2.prefix_len") if exp == "exp2" else "not reported",
    }

    def each(f) -> list[str]:
        return [f(S[x]) for x in d]

    def fd(s: dict) -> str:
        if s["first_divergence_median"] is None:
            return "no divergence"
        q = s["first_divergence_quartiles"]
        return (f"{s['first_divergence_median']:g} ({s['first_divergence_range'][0]}–{s['first_divergence_range'][1]})"
                + (f"; quartiles {q[0]:g}, {q[1]:g}, {q[2]:g}" if q else ""))

    rows = [
        ["rows (problems)", *each(lambda s: str(s["n"])), str(res.reference["setup"]["rows"][exp])],
        ["prefix length, tokens (range)", *each(lambda s: f"{s['prefix_len_range'][0]}–{s['prefix_len_range'][1]}"),
         paper["prefix"]],
        ["replica pairs exact", *each(lambda s: f"{s['replicas_exact']}/{s['n']}"), paper["replicas"]],
        [f"boundary cache not bit-exact, prefill vs {ref}", *each(lambda s: f"{s['boundary_non_exact']}/{s['n']}"),
         paper["boundary"]],
        ["first eligible argmax after the boundary agrees", *each(lambda s: f"{s['first_token_agree']}/{s['n']}"),
         paper["first"]],
        ["**suffix differs**", *each(lambda s: rate(s["suffix"])), paper["suffix"]],
        ["of which tie-initiated (either arm's top-1 − top-2 margin exactly 0 at the first divergent step)",
         *each(lambda s: f"{s['tie_initiated']} of {s['suffix'].k}"), "not reported"],
        ["merge block differs", *each(lambda s: rate(s["merge"])), "not reported"],
        ["answer block differs (any token)", *each(lambda s: rate(s["answer"])), paper["answer"]],
        ["predicted letter differs", *each(lambda s: rate(s["letter"])), "not reported"],
        ["correctness label differs", *each(lambda s: rate(s["label"])), paper["label"]],
        ["first divergence, tokens after the boundary: median (range)", *each(fd), paper["firstdiv"]],
        [f"accuracy, {ref} vs prefill", *each(lambda s: f"{s['accuracy_ref']}/{s['n']} vs {s['accuracy_prefill']}/{s['n']}"),
         paper["accuracy"]],
        [f"prefill − {ref} accuracy, pts [95% bootstrap CI]", *each(lambda s: pts(s["accuracy_diff"])), paper["diff"]],
        [f"exact McNemar, {ref}-only vs prefill-only correct", *each(
            lambda s: f"{s['mcnemar'].b} vs {s['mcnemar'].c}, p = {pval(s['mcnemar'].pvalue)}"), paper["mcnemar"]],
        [f"relative L2 cache drift, prefill vs {ref}: median [range]", *each(
            lambda s: f"{s['drift_median']:.3g} [{s['drift_range'][0]:.3g}, {s['drift_range'][1]:.3g}]"), paper["drift"]],
    ]
    if cross is not None:
        what = "boundary prefix" if exp == "exp1" else "fixed integer prefix"
        rows.append([f"{what} token-identical across precisions", *[f"{cross[0]}/{cross[1]}"] * len(d), paper["cross"]])
    return rows


def _crossing(res: ProfileResults) -> str:
    c = res.summary["crossing"]
    rows = []
    for key, label in (("suffix", "suffix"), ("answer", "answer block"), ("letter", "predicted letter"),
                       ("label", "correctness label")):
        m = c[key]["mcnemar"]
        paper = res.paper_text(f"exp2.reduction.{key}") if key in ("suffix", "answer", "label") else "not reported"
        rows.append([label, pts(c[key]["change"]), f"{m.b} vs {m.c}, p = {pval(m.pvalue)}", paper])
    e = c["accuracy_effect"]
    rows.append(["accuracy effect of prefill (prefill − reference accuracy)",
                 f"{pts(e['change'])} (BF16 {100 * e['bfloat16']:+.1f}, FP32 {100 * e['float32']:+.1f})", "", "—"])
    return table(["disagreement", "FP32 − BF16, pts [95% bootstrap CI]", "exact McNemar: BF16-only vs FP32-only",
                  "the paper: BF16 → FP32 reduction, pts [95% CI]; p"], rows)


def _precondition_ways(t: dict, left: Proportion | None, counted: Proportion | None) -> list[tuple[str, Proportion | None]]:
    """:func:`~kvreplay.experiments.transplant.reported_ways`, each way named as a tag for a table's line."""
    rows = "row" if len(t["ineligible"]) == 1 else f"{len(t['ineligible'])} rows"
    return [(way and f" ({rows} failing the precondition {way.replace('_', ' ').replace('as failure', 'as a failure')})", p)
            for way, p in reported_ways(t, left, counted)]


def _transplant(res: ProfileResults) -> list[str]:
    t = res.summary["transplant"]
    panel = t["rows"] + len(t["ineligible"])
    rows = [
        ["panel rows (frozen divergent + exact)", f"{panel}", res.paper_text("exp4.panel")],
        ["rows whose new baselines reproduce the frozen stratum", f"{t['prior_stratum_reproduced']}/{t['rows']}", "—"],
        ["rows passing every gate", f"{t['rows']}/{panel}", res.paper_text("exp4.gates")],
        ["divergent / exact rows (contemporaneous baselines)", f"{t['divergent']} / {t['exact']}", "—"],
        ["divergent rows tie-initiated / not", f"{t['tie_initiated']} / {t['divergent'] - t['tie_initiated']}", "not reported"],
        *[[f"donor recovery, {d} (integrity check){tag}", rate(p),
           res.paper_text(f"exp4.recovery.{d.replace('<-', '_from_')}")]
          for d, left in t["recovery"].items()
          for tag, p in _precondition_ways(t, left, t["counted_as_failure"]["recovery"][d])],
        *[[label + tag, rate(p), paper_rate(res, f"exp4.{key}")]
          for key, label in (("joint_recovery", "**joint donor recovery, both ways** (integrity check)"),
                             ("third_among_exact", "**third trajectory among exact controls**"))
          for tag, p in _precondition_ways(t, t[key], t["counted_as_failure"][key])],
    ]
    out = [table(["endpoint", "here", "the paper"], rows), ""]
    coarse = [r for r in res.localization if not r["intervention"].startswith("layer_")]
    if coarse:
        out += ["Exploratory partial transplants (not registered; each row: how often the suffix follows the donor, the "
                "recipient, the shared baseline, or a third trajectory):", "",
                table(["intervention", "stratum", "direction", "rows", "donor", "recipient", "baseline", "third"],
                      [[r["intervention"], r["stratum"], r["direction"], r["rows"], r["follows donor"],
                        r["follows recipient"], r["stays on the shared baseline"], r["new (third) trajectory"]]
                       for r in coarse]), ""]
    layers = [r for r in res.localization if r["intervention"].startswith("layer_")]
    if layers:
        cases = sum(r["rows"] for r in layers)
        out += [f"Single-layer transplants ({len({r['intervention'] for r in layers})} layers, both directions, "
                f"{cases} cases on the sweep rows): the suffix follows the donor in "
                f"{sum(r['follows donor'] for r in layers)}, the recipient in {sum(r['follows recipient'] for r in layers)}, "
                f"and takes a third trajectory in {sum(r['new (third) trajectory'] for r in layers)}.", ""]
    return out


def _checkpoint(res: ProfileResults) -> str:
    """The replication checkpoint with its recipe, and whether ``cpu``'s recipe search chose that recipe."""
    ledger = res.ledgers["exp5-bfloat16"]
    recipe, chosen = checkpoint_recipe(ledger.config["checkpoint"], ledger.dir.parent.parent)
    text = res.summary["replication_checkpoint"] + (f", recipe `{recipe}`" if recipe else "")
    if recipe is None or chosen is None:
        return text
    why = "[why](experiments.md#the-checkpoint-family)"
    return text + (f", the recipe `cpu`'s recipe search chooses ({why})" if recipe == chosen else
                   f", which `cpu`'s recipe search rejects: it chooses `{chosen}` ({why})")


def _replication(res: ProfileResults) -> list[str]:
    r, a = res.summary["replication"], res.summary["replication_accuracy"]
    panel = r["rows"] + len(r["ineligible"])
    i, j = r["interpretation"], r["interpretation_scaled"]
    bound = wilson(0, r["exact"]).high if r["exact"] else None
    rows = [
        ["replication checkpoint", _checkpoint(res), "a later training checkpoint"],
        ["panel rows; prefix length, tokens", f"{panel}; {r['prefix_len_range'][0]}–{r['prefix_len_range'][1]}",
         str(res.reference["setup"]["rows"]["exp5"])],
        ["rows passing every gate", f"{r['rows']}/{panel}", "—"],
        ["**suffixes part, prefill vs incremental**", rate(r["divergence"]), paper_rate(res, "exp5.divergence")],
        ["of which tie-initiated", f"{r['tie_initiated']} of {r['divergent']}", "not reported"],
        *[[f"donor recovery, {d} (integrity check)", rate(p), "—"] for d, p in r["recovery"].items()],
        ["joint donor recovery, both ways", rate(r["joint_recovery"]), paper_rate(res, "exp5.joint_recovery")],
        ["new trajectory among exact controls", rate(r["third_among_exact"]), paper_rate(res, "exp5.third_among_exact")],
        ["**frozen interpretation** (the paper's thresholds)", f"{i.label}: {i.reason}", res.paper_text("exp5.interpretation")],
        ["secondary: thresholds scaled to the panel", f"{j.label} ({j.thresholds_text()})", "—"],
    ]
    out = [table(["endpoint", "here", "the paper"], rows), ""]
    if bound is not None:
        out += [f"With {r['exact']} exact controls, 0 new trajectories would exclude rates above {_pct(100 * bound)}% "
                "(Wilson upper bound).", ""]
    out += ["Secondary, decoded accuracy of the incremental arm on the panel (same prefixes and caps):", "",
            table(["", "here"], [
                ["checkpoint 0 (Experiment 2)", rate(a["ckpt0"])], ["later checkpoint (Experiment 5)", rate(a["later"])],
                ["later − checkpoint 0, pts [95% bootstrap CI]", pts(a["diff"])],
                ["exact McNemar, checkpoint-0-only vs later-only correct",
                 f"{a['mcnemar'].b} vs {a['mcnemar'].c}, p = {pval(a['mcnemar'].pvalue)}"],
                ["predicted answer differs", f"{a['answers_differ']}/{a['n']}"]]), ""]
    return out


def _controls(res: ProfileResults) -> list[str]:
    c = res.controls
    if c is None:
        return ["Not run for this profile: no finished `exp2_controls-bfloat16` ledger on its prefix bank "
                "(the profile's `exploratory_controls` turns them on).", ""]
    rows = [
        ["rows", str(c["n"])],
        ["plain BF16: suffixes part, prefill vs incremental", f"{rate(c['baseline'])}; {c['baseline_ties']} tie-initiated"],
        ["FP32 readout of the same BF16 caches: suffixes part",
         f"{rate(c['fp32_readout'])}; {c['fp32_readout_ties']} tie-initiated"],
        ["FP32 readout: still part among rows whose plain suffixes part", rate(c["fp32_readout_among_divergent"])],
        ["matched null perturbation of the incremental cache: trajectory moves",
         f"{rate(c['null_moved'])}; {c['null_ties']} tie-initiated"],
        ["null perturbation: moves among rows whose plain suffixes agree", rate(c["null_moved_among_exact"])],
        ["elements changed per row, median: null vs real", f"{c['null_elements_median']:,.0f} vs {c['real_elements_median']:,.0f}"],
        ["whole-cache relative L2, median: null vs real", f"{c['null_rel_l2_median']:.3g} vs {c['real_rel_l2_median']:.3g}"],
    ]
    return [table(["exploratory control (not in the paper)", "here"], rows), ""]


def _adapt(res: ProfileResults) -> list[str]:
    a = res.adapt
    if a is None:
        return []
    letters = {k: ", ".join(f"{L} {n}" for L, n in v.items()) for k, v in a["letters"].items()}
    rows = [["problems", str(a["n"])], ["accuracy, checkpoint 0", rate(a["acc_a"])],
            ["accuracy, later checkpoint", rate(a["acc_b"])], ["later − checkpoint 0, pts [95% bootstrap CI]", pts(a["diff"])],
            ["exact McNemar, checkpoint-0-only vs later-only correct",
             f"{a['mcnemar'].b} vs {a['mcnemar'].c}, p = {pval(a['mcnemar'].pvalue)}"],
            ["same predicted letter", f"{a['predicted_same']}/{a['n']}"],
            ["predicted letters, checkpoint 0", letters["ckpt0"]], ["predicted letters, later", letters["later"]],
            ["gold letters", letters["gold"]]]
    return ["## The checkpoint family (notebook 00)", "",
            "Teacher-forced answer letter on the MMLU bank, FP32, checkpoint 0 against the later checkpoint that "
            "Experiment 5 replicates on ([experiments.md](experiments.md#the-checkpoint-family)):", "",
            table(["", "here"], rows), ""]


def _cross_hardware(res: ProfileResults) -> list[str]:
    if not res.cross_hardware:
        return []
    rows = [[f"{c['a_label']} (`{c['a']}`) vs {c['b_label']} (`{c['b']}`)", _dtype(c["dtype"]), c["rows"],
             f"{c['prefix_same']}/{c['rows']}", f"{c['live_same']}/{c['rows']}", f"{c['prefill_same']}/{c['rows']}",
             f"{c['divergent_a']} / {c['divergent_b']}"] for c in res.cross_hardware]
    return ["## Across hardware", "",
            "Experiment 1 rows that two setups share, compared token for token (`python -m kvreplay.report.cross_hardware`; "
            "[reproducibility.md](reproducibility.md#what-reproduces-where)):", "",
            table(["setups", "precision", "shared rows", "boundary prefix same", "prefix + live suffix same",
                   "prefix + prefill suffix same", "suffixes part (first / second setup)"], rows), ""]


def results_page(res: ProfileResults, families: Families | None = None) -> str:
    """``docs/results-<profile>.md``: every endpoint of the profile beside the paper's, with where it was computed
    (and another model family's profile beside it: ``families``, :func:`~kvreplay.report.cross_family.family_results`)."""
    p = res.profile
    S = res.summary
    m = res.model
    d = list(S["exp1"])
    ledger_rows = [[f"`{k}`", f"`{v.dir.name}`", len(v.records), res.gate_failures[k]] for k, v in res.ledgers.items()]
    lines = [
        f"<!-- generated from data/ledgers/{p}/ and data/paper/reference.yaml by `make paper PROFILE={p}` "
        f"({TOOL} --profile {p}); do not edit -->",
        f"# Results of the `{p}` profile", "",
        f"Every number below is recomputed from the ledgers in `data/ledgers/{p}/` by the experiments' own summary "
        f"functions; the paper's come from `data/paper/reference.yaml`. `make paper PROFILE={p}` rewrites this page and "
        "a test requires it byte for byte. Brackets hold Wilson 95% intervals in percent; bootstrap intervals use "
        f"{res.n_resamples:,} problem-paired resamples (seed {res.seed}). The executed notebooks are in "
        f"[`executed/{p}/`](../executed/{p}/README.md), the tables and figures in `figures/{p}/`; what each endpoint "
        "means is in [experiments.md](experiments.md), what separates this setup from the paper's in "
        "[differences.md](differences.md).", "",
        "## Setup", "",
        f"- Model: `{m.get('file') or m.get('model')}` ({m.get('architecture', '?')}, {m.get('layers', '?')} layers, "
        f"{m.get('kv_heads', '?')} KV heads, head dim {m.get('head_dim', '?')}).",
        f"- Where: {where_text(res)}",
        f"- Gates: {gates_text(res)}",
        "- Each ledger's run log (`runlog.jsonl` beside its rows) records its runs: start, rows, gates, seconds.", "",
        table(["ledger", "folder", "rows", "rows with a gate failure"], ledger_rows), "",
        "## Experiment 1: live vs prefill (§4.1)", "",
        table(["endpoint", *(_dtype(x) for x in d), "the paper"], _matrix_rows(res, "exp1")), "",
        "## Experiment 2: fixed prefixes, prefill vs incremental (§4.2)", "",
        table(["endpoint", *(_dtype(x) for x in S["exp2"]), "the paper"], _matrix_rows(res, "exp2")), "",
    ]
    if S["crossing"]:
        lines += ["Paired change from BF16 to FP32 on the same problems:", "", _crossing(res), ""]
    b, au = S["bridge"], S["audit"]
    lines += [
        "## Experiment 3: the bridge and the saved-ledger audit (§4.3)", "",
        table(["endpoint", "here", "the paper"], [
            ["bridge rows; new prefix length, tokens", f"{b['n']}; {b['prefix_len_range'][0]}–{b['prefix_len_range'][1]}",
             f"{res.reference['setup']['rows']['exp3']}; {res.paper_text('exp3.bridge.prefix_len')}"],
            ["**incremental bit-exact to live on every layer**", f"{b['layers_exact']}/{b['n']}",
             res.paper_text("exp3.bridge.layers_exact")],
            ["boundary logits exact", f"{b['logits_exact']}/{b['n']}", res.paper_text("exp3.bridge.logits_exact")],
            ["complete suffix exact", f"{b['suffix_exact']}/{b['n']}", res.paper_text("exp3.bridge.suffix_exact")],
            ["new live prefix token-identical to the saved one", f"{b['same_as_saved']}/{b['n']}",
             res.paper_text("exp3.bridge.same_as_saved")],
            ["audit: problem order agrees", f"{'yes' if au['order_agrees'] else 'no'} ({au['rows']} rows)",
             res.paper_text("exp3.audit.order")],
            ["audit: prefixes agree", f"{au['prefix_agrees']}/{au['rows']}", "—"],
            *[[f"audit: suffix reproduced, {k}", f"{v}/{au['rows']}", res.paper_text("exp3.audit.suffix")]
              for k, v in au["suffix_agrees"].items()],
            ["audit: common cache leaves per row; rows where all agree",
             f"{', '.join(map(str, au['cache_leaves']))}; {au['cache_leaves_agree_rows']}/{au['rows']}",
             res.paper_text("exp3.audit.cache_leaves")],
            ["audit: common logit leaves per row; rows where all agree",
             f"{', '.join(map(str, au['logit_leaves']))}; {au['logit_leaves_agree_rows']}/{au['rows']}",
             res.paper_text("exp3.audit.logit_leaves")],
        ]), "",
        "## Experiment 4: whole-cache transplants (§4.4)", "", *_transplant(res),
        "## Experiment 5: the replication on a later checkpoint (§4.5)", "", *_replication(res),
        "## Exploratory controls (Experiment 2's BF16 caches; not in the paper)", "", *_controls(res),
        *_adapt(res), *_cross_hardware(res), *families_section(families, res.reference),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


# ----------------------------------------------------------------------------- write and check


_LINK = re.compile(r"\]\((?!https?:|#|/|\./)([^)#]+)(#[^)]*)?\)")


def relinked(text: str, page: Path, root: Path, profile: str) -> str:
    """A results page's text with its relative links (written for ``docs/``) made relative to ``page``'s folder, for
    a page written elsewhere (``build/<profile>/results.md``). There the executed notebooks are ``make paper``'s
    copies beside the page, indexed by ``index.html``; ``text`` is returned unchanged for a page in ``docs/``."""
    docs = (Path(root) / "docs").resolve()
    here = Path(page).resolve().parent
    if here == docs:
        return text
    text = text.replace(f"`make paper PROFILE={profile}` rewrites this page and a test requires it byte for byte.",
                        f"`make paper PROFILE={profile}` rewrites this page.")
    text = text.replace(f"[`executed/{profile}/`](../executed/{profile}/README.md)",
                        f"[`build/{profile}/`](./index.html) (executed notebooks and their HTML)")
    return _LINK.sub(lambda m: f"]({os.path.relpath(docs / m.group(1), here)}{m.group(2) or ''})", text)


def expected(profile: str, root: Path, res: ProfileResults, page: Path | None = None,
             readme: bool | None = None, families: Families | None = None) -> dict[Path, str]:
    """What each generated file should hold: the results page (``page``, default :func:`page_path`; with
    ``families``), and the README with its block when ``readme`` (default: ``profile`` is :data:`HEADLINE_PROFILE`)."""
    target = Path(page) if page else page_path(profile, root)
    out = {target: relinked(results_page(res, families), target, Path(root), profile)}
    if profile == HEADLINE_PROFILE if readme is None else readme:
        path = Path(root) / "README.md"
        out[path] = replace_block(path.read_text(encoding="utf-8"), headline_block(res), profile)
    return out


def _first_difference(have: str, want: str) -> str:
    a, b = have.splitlines(), want.splitlines()
    for i, (x, y) in enumerate(zip(a, b), 1):
        if x != y:
            return f"line {i}: has {x[:100]!r}, the ledgers give {y[:100]!r}"
    return f"has {len(a)} lines, the ledgers give {len(b)}"


def check(profile: str, root: Path = ROOT, res: ProfileResults | None = None,
          ledger_root: Path = LEDGERS) -> list[str]:
    """Each generated file or block of ``profile`` that differs from what its ledgers give, named, with the first
    differing line; ``[]`` when all agree.

    Raises:
        MissingLedgerError, GateError: as :func:`~kvreplay.report.results.profile_results`.
        ValueError: the README lacks the headline block (headline profile only), or the profile's cross-family
            partner holds other problems (:func:`~kvreplay.report.cross_family.same_problems`).
    """
    res = res or profile_results(profile, ledger_root, **profile_stats(profile))
    out = []
    for path, want in expected(profile, Path(root), res, families=family_results(res, ledger_root)).items():
        name = path.relative_to(root)
        if not path.is_file():
            out.append(f"{name}: missing (`make paper PROFILE={profile}` writes it)")
            continue
        have = path.read_text(encoding="utf-8")
        if path.name == "README.md":
            have_block = next(m.group(0) for m in BLOCK.finditer(have) if m["profile"] == profile)
            want_block = headline_block(res)
            if have_block != want_block:
                out.append(f"README.md, block results-headline:{profile}: {_first_difference(have_block, want_block)}")
        elif have != want:
            out.append(f"{name}: {_first_difference(have, want)}")
    return out


def regenerate(profile: str, root: Path = ROOT, res: ProfileResults | None = None, ledger_root: Path = LEDGERS, *,
               page: Path | None = None, readme: bool | None = None) -> list[Path]:
    """Rewrite the results page of ``profile`` (and the README's block: see :func:`expected`) under ``root``.

    Returns:
        the files whose text changed.

    Raises:
        as :func:`check`.
    """
    res = res or profile_results(profile, ledger_root, **profile_stats(profile))
    changed = []
    for path, text in expected(profile, Path(root), res, page, readme, family_results(res, ledger_root)).items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            changed.append(path)
    return changed


def main(argv: list[str] | None = None) -> int:
    """Rewrite a profile's results page (and the README's block), or with ``--check`` name what differs.

    Exit status: 0 written or in agreement; 1 ``--check`` found a difference; 2 the ledgers cannot be read as needed.
    """
    ap = argparse.ArgumentParser(prog=TOOL, description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=HEADLINE_PROFILE, help=f"a profile with committed ledgers (default {HEADLINE_PROFILE})")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 and name each file or block that differs")
    ap.add_argument("--root", type=Path, default=ROOT, help="where README.md and docs/ are (default: this checkout)")
    ap.add_argument("--ledger-root", type=Path, default=LEDGERS, help="folder holding <profile>/ ledger folders")
    args = ap.parse_args(argv)
    try:
        if args.check:
            diffs = check(args.profile, args.root, ledger_root=args.ledger_root)
            for d in diffs:
                print(d)
            if diffs:
                print(f"{len(diffs)} difference(s): `{TOOL} --profile {args.profile}` rewrites them", file=sys.stderr)
                return 1
            print(f"the results of {args.profile} agree with data/ledgers/{args.profile}/")
            return 0
        changed = regenerate(args.profile, args.root, ledger_root=args.ledger_root)
        print("\n".join(f"rewritten: {p.relative_to(args.root)}" for p in changed) or "unchanged")
        return 0
    except (MissingLedgerError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
