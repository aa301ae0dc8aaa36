"""The engine-against-``generate`` table of ``docs/engine.md``, rendered from a committed bench file.

``python -m kvreplay.bench --vs-generate --json FILE`` writes a list of records (one per path, batch and flag
set). :func:`side_by_side` turns them into Markdown: per batch size B, the engine's step beside the fastest
``generate`` configuration, the memory floor and the engine's multiple of it, and the end-to-end Experiment 1
chunk. ``python -m kvreplay.report.engine_bench [--check]`` rewrites (or checks) the marked block of
``docs/engine.md`` and the README's one-sentence engine-speed block from ``data/device/h200/engine_vs_generate.json``;
numbers are never typed by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ..paths import ROOT

BENCH_FILE = ROOT / "data" / "device" / "h200" / "engine_vs_generate.json"
SUITE_FILE = ROOT / "data" / "device" / "h200" / "engine_suite.json"
DOC = ROOT / "docs" / "engine.md"
README = ROOT / "README.md"
BEGIN = "<!-- engine-vs-generate: generated from data/device/h200/engine_vs_generate.json by " \
        "python -m kvreplay.report.engine_bench; do not edit -->"
END = "<!-- /engine-vs-generate -->"
README_BEGIN = "<!-- engine-speed: generated from data/device/h200/engine_vs_generate.json by " \
               "python -m kvreplay.report.engine_bench; do not edit -->"
README_END = "<!-- /engine-speed -->"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _fmt(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.2f}"


def side_by_side(records: Sequence[dict]) -> str:
    """Markdown tables of a bench file's records (:func:`kvreplay.bench.engine_vs_generate` and the end-to-end chunk).

    Args:
        records: dicts with ``path``, ``B``, ``ms_per_problem_step`` (milliseconds per problem-step), ``ms_per_step``,
            ``floor_ms``, ``x_floor`` and ``flags``; an ``engine-exp1-end-to-end`` record adds ``occupancy``,
            ``useful_problem_steps_per_s``, ``chunk_seconds``, ``arm_seconds`` and ``problems``.

    Returns:
        The Markdown of the block (two tables and their notes).

    Raises:
        ValueError: a batch size without an ``engine`` record or without any ``generate`` record.
    """
    steady = [r for r in records if r["path"] != "engine-exp1-end-to-end"]
    env = steady[0].get("environment", {}) if steady else {}
    half: list[int] = []
    lines = [f"{env.get('device', 'GPU')}, torch {env.get('torch', '?')}, {env.get('dtype', '?')}, the embedded "
             f"SmolLM2-135M; boundaries from the `paper` profile's prefix bank (caps "
             f"{steady[0]['caps'] if steady else '?'}); milliseconds per problem-step (one token of one problem, its "
             "two duplicate rows), steady state.", "",
             "| B | engine (`flex`) | engine (`grouped`) | fastest `generate` | which | engine / fastest `generate` | "
             "floor | engine x floor |", "|---|---|---|---|---|---|---|---|"]
    for b in sorted({r["B"] for r in steady}):
        at = [r for r in steady if r["B"] == b]
        eng = [r for r in at if r["path"] == "engine"]
        gen = [r for r in at if r["path"].startswith("generate")]
        if not eng or not gen:
            raise ValueError(f"B = {b}: the bench file needs an 'engine' record and at least one 'generate' record")
        e, g = eng[0], min(gen, key=lambda r: r["ms_per_problem_step"])
        grouped = [r for r in at if r["path"] == "engine-grouped"]
        if e["ms_per_problem_step"] <= g["ms_per_problem_step"] / 2:
            half.append(b)
        lines.append(f"| {b} | {_fmt(e['ms_per_problem_step'])} | "
                     f"{_fmt(grouped[0]['ms_per_problem_step']) if grouped else '—'} | "
                     f"{_fmt(g['ms_per_problem_step'])} | `{g['path']}`, {g['flags']} flags | "
                     f"{e['ms_per_problem_step'] / g['ms_per_problem_step']:.2f} | "
                     f"{_fmt(e['floor_ms'] / b)} | {e['x_floor']:.1f} |")
    lines += ["", "The engine's step costs at most half of the fastest `generate` configuration at B = "
              + (", ".join(map(str, half)) if half else "none of these") + "."]
    e2e = [r for r in records if r["path"] == "engine-exp1-end-to-end"]
    for r in e2e:
        live = (f", the live boundary of every row rebuilt and checked bit for bit ({r['live_checks_passed']} checks "
                f"passed)" if r.get("live_checks_passed") else "")
        lines += ["", f"Experiment 1 end to end ({r['problems']} problems in one chunk at B = {r['B']}, attention "
                  f"`{r['attention']}`, every gate on{live}): slot occupancy {r['occupancy']:.1%}, "
                  f"{r['useful_problem_steps_per_s']:.0f} useful problem-steps per second, {r['chunk_seconds']:.0f} s "
                  f"for the chunk and {r['arm_seconds']:.0f} s for the arm with its preflight gates "
                  f"({r['gate_failures']} gate failures)."]
    lines += ["", "Every configuration measured, with the commands that made them and the engine step's profiler "
              "table: `data/device/h200/engine_vs_generate.md`."]
    return "\n".join(lines)


def suite_summary(suite: dict) -> str:
    """One Markdown list of what ``python -m kvreplay.bench engine-suite`` saw (its JSON: ``sections`` by name).

    Raises:
        KeyError: a section the summary reads is missing from ``suite``.
    """
    sec = suite["sections"]
    g, d, c, f, t = (sec["graph_equals_eager"], sec["determinism"], sec["composition"], sec["fp32_rows"],
                     sec["tolerance"])
    tol = ", ".join(f"{k} {v['max_rel_err']:.2g} (tolerance {v['tolerance']:g})" for k, v in sorted(t.items())
                    if isinstance(v, dict))
    return "\n".join([
        f"On the {suite['device']} (`python3 -m kvreplay.bench engine-suite OUT`, attention `flex`, the compiled kernels "
        f"under the CUDA contract):",
        "",
        f"- graph step equal to the eager step bit for bit on {g['steps_checked_bit_for_bit']} checked steps; the whole "
        f"decode on the eager path equal to the graph path on {g['eager_path_equal']} of {g['of']} problems;",
        f"- two more runs equal to the first: {', '.join(map(str, d['runs_equal_to_the_first']))} of {d['of']};",
        f"- a problem with {c['companions']} companions in slot 0, alone in the last slot, and with its companions in "
        f"another order: alone in the last slot equal bit for bit: "
        f"{_yes(c['slot_0_with_companions_vs_alone_in_the_last_slot'])}; other companion order: "
        f"{_yes(c['slot_0_vs_the_last_slot_other_companion_order'])};",
        f"- largest relative error of any layer's attention output against math SDPA in float64: {tol};",
        f"- the `gpu` profile's committed FP32 Experiment 1 rows recomputed by `flex`: live prefix token-identical "
        f"{f['prefix_token_identical']}/{f['rows']}, all four suffixes token-identical "
        f"{f['all_four_suffixes_token_identical']}/{f['rows']}, {f['gate_failures']} gate failures, slot occupancy "
        f"{f['occupancy']:.1%}.",
    ])


def headline(records: Sequence[dict]) -> str:
    """The README's sentence on the engine's speed: B = 64 and the end-to-end arm, with the command.

    Raises:
        ValueError: no B = 64 ``engine`` and ``generate`` records, or no end-to-end record.
    """
    at = [r for r in records if r["B"] == 64 and r["path"] != "engine-exp1-end-to-end"]
    eng = [r for r in at if r["path"] == "engine"]
    gen = [r for r in at if r["path"].startswith("generate")]
    e2e = [r for r in records if r["path"] == "engine-exp1-end-to-end"]
    if not eng or not gen or not e2e:
        raise ValueError("the bench file needs B = 64 engine and generate records and an end-to-end record")
    e, g, x = eng[0], min(gen, key=lambda r: r["ms_per_problem_step"]), e2e[0]
    return (f"On an {e.get('environment', {}).get('device', 'H200')}, at B = 64 problems per step and the paper's caps, "
            f"the engine's `flex` step takes {_fmt(e['ms_per_problem_step'])} ms per problem-step against "
            f"{_fmt(g['ms_per_problem_step'])} for the fastest Hugging Face `generate` doing the same work "
            f"(`{g['path']}`, {g['flags']} flags), {e['x_floor']:.1f} times the memory floor; Experiment 1's "
            f"{x['problems']} BF16 rows at those caps, every gate on, take {x['arm_seconds']:.0f} s with "
            f"{x['occupancy']:.0%} of the slots busy (`make bench BENCH_ARGS=\"--vs-generate --device cuda\"`; commands "
            f"and every configuration in [docs/engine.md](docs/engine.md)).")


def _replace_block(text: str, begin: str, end: str, body: str) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"no block between {begin!r} and {end!r}")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render_readme(text: str, records: Sequence[dict]) -> str:
    """The README ``text`` with its engine-speed block replaced by :func:`headline`.

    Raises:
        ValueError: the README has no marked block.
    """
    return _replace_block(text, README_BEGIN, README_END, headline(records))


def render_doc(text: str, records: Sequence[dict], suite: dict | None = None) -> str:
    """``text`` (a page) with its marked block replaced by :func:`side_by_side` of ``records`` (and ``suite``).

    Raises:
        ValueError: the page has no marked block.
    """
    if BEGIN not in text or END not in text:
        raise ValueError(f"no block between {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    body = side_by_side(records) + (f"\n\n{suite_summary(suite)}" if suite is not None else "")
    return f"{head}{BEGIN}\n\n{body}\n\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Rewrite the engine blocks of ``docs/engine.md`` and the README (exit 0); ``--check``: exit 1 if one differs."""
    ap = argparse.ArgumentParser(prog="python -m kvreplay.report.engine_bench", description=main.__doc__)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the block differs")
    args = ap.parse_args(argv)
    records = json.loads(BENCH_FILE.read_text(encoding="utf-8"))
    suite = json.loads(SUITE_FILE.read_text(encoding="utf-8"))
    differs = 0
    for page, render in ((DOC, lambda t: render_doc(t, records, suite)), (README, lambda t: render_readme(t, records))):
        text = page.read_text(encoding="utf-8")
        new = render(text)
        if new == text:
            print(f"{page.relative_to(ROOT)}: up to date")
        elif args.check:
            print(f"{page.relative_to(ROOT)}: its engine block differs from {BENCH_FILE.relative_to(ROOT)}")
            differs = 1
        else:
            page.write_text(new, encoding="utf-8")
            print(f"{page.relative_to(ROOT)}: rewritten")
    return differs


if __name__ == "__main__":
    sys.exit(main())
