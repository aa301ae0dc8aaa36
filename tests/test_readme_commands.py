"""Every command the README shows runs as written from a fresh clone after `make setup`, and every section it
points to exists.

What is checked, command by command (the shell blocks' lines, and inline code that starts with a command):
- ``make [VAR=value ...] [target ...]``: each target is a target of the Makefile;
- ``.venv/bin/<program>``: the program is in this checkout's venv (made by ``make setup``);
- ``.venv/bin/python -m <module>``: the module imports (it is found, with its package);
- ``.venv/bin/papermill <notebook> <out> [-p profile NAME]``: the notebook and ``notebooks/params/NAME.yaml`` exist;
- a script path (``scripts/x.py``, ``bash .ci/run``): the file exists;
- bare ``python``, ``papermill``, ``jupyter``, ``pytest``, ``jupytext``, ``mypy``, ``pip``: refused, since a fresh clone
  has no activated venv (write ``.venv/bin/papermill``), unless the same block activates it first
  (``source .venv/bin/activate``);
- any other program must be a common shell tool (``git``, ``cd``, ``ls``, ...) or on the PATH here.
A cross-reference (``see "Section"``, ``under "Section"``, ``("Section")``) must name a heading of the README.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
from pathlib import Path

import pytest
from kvreplay.paths import ROOT

README = ROOT / "README.md"

SHELL_LANGS = {"sh", "bash", "shell", "console", "zsh"}
VENV_ONLY = {"python", "papermill", "jupyter", "pytest", "jupytext", "mypy", "pip", "ipython", "jupyter-lab"}
"""Programs a fresh clone has only in ``.venv/bin`` (``python`` may exist on the PATH, but without the lock's
packages): bare, they do not run as written."""
SHELL_TOOLS = {"cd", "ls", "cat", "rm", "cp", "mv", "mkdir", "export", "echo", "git", "tar", "gzip", "gunzip", "diff",
               "head", "tail", "grep", "find", "du", "env", "source", ".", "bash", "sh", "sudo", "apt-get", "apt",
               "python3", "python3.11", "nproc", "time", "chmod", "wget", "curl", "unset", "test", "true", "uv", "conda",
               "mamba"}
COMMAND_START = re.compile(r"^(make|\.venv/bin/|python3?(\.11)?\s|papermill\s|jupyter\s|pytest|jupytext|mypy\s|pip\s|bash\s"
                           r"|scripts/|git\s)")
"""Inline code that starts like this is a command (checked as one); other inline code is a name or a value."""


def shell_commands(text: str) -> list[tuple[str, list[str], bool]]:
    """``(where, argv, venv_active)`` for every command of the README's shell blocks and command-like inline code.

    A block's lines are joined at a trailing backslash, comments and prompts (``$ ``) are dropped, and a line is
    split at ``&&``, ``;`` and ``|``. ``venv_active``: an earlier line of the same block sourced ``.venv/bin/activate``.
    """
    out = []
    fence = re.compile(r"^```(\w*)\s*$")
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = fence.match(lines[i])
        if not m:
            for span in re.findall(r"`([^`\n]+)`", lines[i]):
                if COMMAND_START.match(span):
                    out += [(f"README.md:{i + 1} (inline)", argv, False) for argv in _split(span)]
            i += 1
            continue
        lang, start, i = m.group(1).lower(), i + 1, i + 1
        block = []
        while i < len(lines) and not lines[i].startswith("```"):
            block.append(lines[i])
            i += 1
        i += 1
        if lang not in SHELL_LANGS:
            continue
        active = False
        joined = "\n".join(block).replace("\\\n", " ")
        for n, line in enumerate(joined.splitlines()):
            line = line.strip()
            if line.startswith("$ "):
                line = line[2:]
            if not line or line.startswith("#"):
                continue
            for argv in _split(line):
                out.append((f"README.md:{start + n + 1}", argv, active))
                if argv[:2] in (["source", ".venv/bin/activate"], [".", ".venv/bin/activate"]):
                    active = True
    return out


def _split(line: str) -> list[list[str]]:
    """The commands of one shell line, each as argv (comments, leading ``VAR=value`` assignments and ``time`` off)."""
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # an unbalanced quote: one token per word, enough to name the program
        tokens = line.split()
    commands, current = [], []
    for t in tokens:
        if t in ("&&", "||", ";", "|"):
            commands.append(current)
            current = []
        else:
            current.append(t)
    commands.append(current)
    out = []
    for argv in commands:
        while argv and (re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]) or argv[0] == "time"):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def make_targets() -> set[str]:
    """The Makefile's explicit targets (``name:`` at the start of a line, and the .PHONY list)."""
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))
    for phony in re.findall(r"^\.PHONY:(.*)$", text, re.M):
        targets |= set(phony.split())
    return targets


def problems_with(argv: list[str], venv_active: bool, targets: set[str]) -> list[str]:
    """Why ``argv`` would not run as written in a fresh clone after ``make setup`` (empty: it would)."""
    prog, args = argv[0], argv[1:]
    venv = ROOT / ".venv" / "bin"
    if prog == "make":
        named = [a for a in args if not a.startswith("-") and "=" not in a]
        return [f"make target {t!r} is not in the Makefile" for t in named if t not in targets]
    if prog.startswith(".venv/bin/") or (venv_active and prog in VENV_ONLY):
        name = prog.removeprefix(".venv/bin/")
        if not (venv / name).exists():
            return [f"{prog}: no such program in .venv/bin (made by make setup)"]
        if name.startswith("python") and len(args) >= 2 and args[0] == "-m":
            module = args[1]
            if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
                return [f"python -m {module}: no such module"]
        if name == "papermill":
            return _papermill_problems(args)
        if name.startswith("python") and args and args[0].endswith(".py") and not (ROOT / args[0]).is_file():
            return [f"{args[0]}: no such script"]
        return []
    if prog in VENV_ONLY:
        return [f"bare `{prog}` does not run in a fresh clone (the venv is not activated): write .venv/bin/{prog}"]
    if prog.startswith(("scripts/", "./", ".ci/")) or prog.endswith((".py", ".sh")):
        return [] if (ROOT / prog).is_file() else [f"{prog}: no such file"]
    if prog in ("bash", "sh") and args and not args[0].startswith("-"):
        return [] if (ROOT / args[0]).is_file() else [f"{args[0]}: no such file"]
    if prog in SHELL_TOOLS or shutil.which(prog):
        return []
    return [f"{prog}: not a program of the repository, its venv or a common shell"]


def _papermill_problems(args: list[str]) -> list[str]:
    out = []
    positional = [a for i, a in enumerate(args) if not a.startswith("-") and (i == 0 or not args[i - 1].startswith("-"))]
    if positional and positional[0].endswith(".ipynb") and not (ROOT / positional[0]).is_file():
        out.append(f"papermill input {positional[0]}: no such notebook")
    for i, a in enumerate(args[:-2]):
        if a in ("-p", "--parameters") and args[i + 1] == "profile":
            profile = args[i + 2]
            if not (profile.endswith((".yaml", ".yml")) or (ROOT / "notebooks" / "params" / f"{profile}.yaml").is_file()):
                out.append(f"papermill -p profile {profile}: no notebooks/params/{profile}.yaml")
    return out


def cross_references(text: str) -> list[str]:
    """The quoted section names the README points to that are none of its headings (a heading may go on past the
    name: "The `paper` profile" names "The `paper` profile (caps ...)"). Pointers: ``see "X"``, ``under "X"``,
    ``section "X"``, and ``("X"`` where X is close to a heading (a quote in parentheses may be a phrase instead)."""
    import difflib

    headings = [re.sub(r"^#+\s*", "", h).strip() for h in re.findall(r"^#{1,6}\s.*$", text, re.M)]

    def found(ref: str) -> bool:
        return any(h == ref or h.startswith(ref + " ") for h in headings)

    said = re.findall(r"(?:\bsee|\bunder|\bsection)\s+\"([A-Z][^\"\n]{2,100})\"", text)
    bracketed = [r for r in re.findall(r"\(\"([A-Z][^\"\n]{2,100})\"", text)
                 if difflib.get_close_matches(r, headings, n=1, cutoff=0.6)]
    return sorted({r for r in [*said, *bracketed] if not found(r)})


# ----------------------------------------------------------------------------- the README itself


def test_every_readme_command_runs_as_written():
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("no .venv here: run make setup first (the commands are checked against it)")
    targets = make_targets()
    commands = shell_commands(README.read_text())
    assert commands, "no command found in README.md"
    bad = [f"{where}: {' '.join(argv)}: {why}" for where, argv, active in commands
           for why in problems_with(argv, active, targets)]
    assert not bad, "README commands that do not run as written:\n" + "\n".join(bad)


def test_every_readme_cross_reference_names_a_section():
    missing = cross_references(README.read_text())
    assert not missing, f"README points to sections it does not have: {missing}"


# ----------------------------------------------------------------------------- the checker fails where it should


def test_the_checker_refuses_what_would_not_run(tmp_path):
    text = "\n".join([
        "Run `make paper PROFILE=gpu` or `make lab`, then `papermill notebooks/01_experiment1_live_vs_prefill.ipynb o.ipynb`.",
        "```sh", "make nosuchtarget", "python -m kvreplay.paper --profile cpu   # bare python",
        ".venv/bin/python -m kvreplay.nosuchmodule", ".venv/bin/papermill notebooks/99_none.ipynb out.ipynb -p profile nope",
        ".venv/bin/nosuchtool --help", "scripts/nosuch.py", "HF_HUB_OFFLINE=1 .venv/bin/python -m kvreplay.verify \\",
        "  --profile cpu && git status", "```",
        "```sh", "source .venv/bin/activate", "papermill notebooks/06_tables.ipynb out.ipynb -p profile cpu", "```",
        "```yaml", "make: nothing here is a command", "```",
        'As said (see "The two commands"; also "Differences from the paper") and see "No such section";',
        '("The two comands") is a typo, ("The answer is") a phrase, see "The `paper` profile" a prefix.',
        "# The two commands", "## Differences from the paper", "## The `paper` profile (caps 768 / 512 / 64)",
    ])
    targets = make_targets()
    found = {" ".join(argv): problems_with(argv, active, targets) for _, argv, active in shell_commands(text)}
    assert found["make paper PROFILE=gpu"] == [] and found["make lab"] == []
    assert found["papermill notebooks/01_experiment1_live_vs_prefill.ipynb o.ipynb"][0].startswith("bare `papermill`")
    assert found["make nosuchtarget"] == ["make target 'nosuchtarget' is not in the Makefile"]
    assert found["python -m kvreplay.paper --profile cpu"][0].startswith("bare `python`")
    if (ROOT / ".venv" / "bin" / "python").exists():
        assert found[".venv/bin/python -m kvreplay.nosuchmodule"] == ["python -m kvreplay.nosuchmodule: no such module"]
        assert found[".venv/bin/papermill notebooks/99_none.ipynb out.ipynb -p profile nope"] == [
            "papermill input notebooks/99_none.ipynb: no such notebook", "papermill -p profile nope: no notebooks/params/nope.yaml"]
        assert found[".venv/bin/nosuchtool --help"] == [".venv/bin/nosuchtool: no such program in .venv/bin (made by make setup)"]
        assert found[".venv/bin/python -m kvreplay.verify --profile cpu"] == []  # a continued line, VAR= prefix dropped
        assert found["papermill notebooks/06_tables.ipynb out.ipynb -p profile cpu"] == []  # the block activated the venv
    assert found["scripts/nosuch.py"] == ["scripts/nosuch.py: no such file"] and found["git status"] == []
    assert "make: nothing here is a command" not in found
    assert cross_references(text) == ["No such section", "The two comands"]
