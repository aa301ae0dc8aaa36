"""The typed overloads of ``validate_rows`` and ``ProfileLedgers.records``, generated from
:data:`kvreplay.arm_facts.ARM_FACTS` (mypy cannot read a record type from a table at run time).

A literal experiment (``validate_rows("exp1", rows)``) or ledger key (``records("exp4-bfloat16")``) types the rows as
its record. Each overload block sits between marker comments in :mod:`.records` and :mod:`.lookup`;
``python -m kvreplay.ledger.overloads`` rewrites both from the facts (``--check``: change nothing, exit 1 when a
block differs). A test runs the check, so an arm added to the facts fails it until the blocks are regenerated.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ..arm_facts import ARM_FACTS, ArmFacts

_HERE = Path(__file__).parent


def record_alias(f: ArmFacts) -> str:
    """The type name of an arm's rows, failed ones included: ``Exp1Record`` (``Exp1Row | Exp1FailedRow``), or its
    :attr:`~kvreplay.arm_facts.ArmFacts.record` itself when it has no failed-row record (``AdaptEvalRow``)."""
    from .records import FAILED_ROW_TYPES

    return f"{f.record.removesuffix('Row')}Record" if f.experiment in FAILED_ROW_TYPES else f.record


def validate_rows_block() -> str:
    """The ``validate_rows`` overloads, one per arm of the facts, in their order."""
    return "".join(f'@overload\ndef validate_rows(experiment: Literal["{e}"], rows: Iterable[Any]) -> '
                   f"list[{record_alias(f)}]: ...\n" for e, f in ARM_FACTS.items())


def records_block() -> str:
    """The ``ProfileLedgers.records`` overloads: one per arm the paper assembly reads, its ledger keys (one per
    precision) in one ``Literal``."""
    out = ""
    for f in ARM_FACTS.values():
        if f.assembly:
            keys = ", ".join(f'"{label}"' for label in f.labels())
            out += f"    @overload\n    def records(self, key: Literal[{keys}]) -> list[{record_alias(f)}]: ...\n"
    return out


BLOCKS = {"validate_rows": (_HERE / "records.py", validate_rows_block),
          "ProfileLedgers.records": (_HERE / "lookup.py", records_block)}
"""Block name -> the file holding it between ``# <generated: NAME>`` and ``# </generated: NAME>`` lines, and
its text."""


def _span(text: str, name: str, path: Path) -> re.Match[str]:
    m = re.search(rf"^[ \t]*# <generated: {re.escape(name)}>[^\n]*\n(?P<body>.*?)^[ \t]*# </generated: "
                  rf"{re.escape(name)}>", text, flags=re.M | re.S)
    if m is None:
        raise ValueError(f"{path}: no '# <generated: {name}>' ... '# </generated: {name}>' block")
    return m


def stale() -> list[str]:
    """The blocks whose text in their file differs from what the facts give now (names of :data:`BLOCKS`)."""
    out = []
    for name, (path, build) in BLOCKS.items():
        if _span(path.read_text(encoding="utf-8"), name, path)["body"] != build():
            out.append(name)
    return out


def write() -> list[str]:
    """Rewrite every stale block in its file; returns the names rewritten."""
    done = stale()
    for name in done:
        path, build = BLOCKS[name]
        text = path.read_text(encoding="utf-8")
        m = _span(text, name, path)
        path.write_text(text[:m.start("body")] + build() + text[m.end("body"):], encoding="utf-8")
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.ledger.overloads", description=__doc__)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block differs")
    args = ap.parse_args(argv)
    if args.check:
        bad = stale()
        for name in bad:
            print(f"stale: {name} in {BLOCKS[name][0]} (run python -m kvreplay.ledger.overloads)", file=sys.stderr)
        return 1 if bad else 0
    for name in write():
        print(f"rewrote {name} in {BLOCKS[name][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
