"""The repository stays light enough to travel (a device call carries the tracked tree plus one model part), the
library's imports form no cycle, and its text points to nothing outside it."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRACKED_LIMIT = 30 * 2**20
"""Bytes the tracked files may take: a device call carries at most 64 MiB, and a model travels beside the tree in
parts of at most 27 MiB (the embedded GGUF in four, Gemma 3 in nine, scripts/offline_gpu_env.sh) with the carried
wheels and a frozen library (about 5 MiB)."""


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:  # a source tarball without .git
        pytest.skip(f"not a git checkout ({e})")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_tracked_tree_fits_beside_a_model_part():
    files = [f for f in tracked_files() if f.is_file()]
    total = sum(f.stat().st_size for f in files)
    biggest = sorted(files, key=lambda f: f.stat().st_size, reverse=True)[:5]
    assert total <= TRACKED_LIMIT, (
        f"tracked files take {total / 2**20:.1f} MiB, over {TRACKED_LIMIT / 2**20:.0f} MiB; largest: "
        + ", ".join(f"{f.relative_to(ROOT)} ({f.stat().st_size / 2**20:.1f} MiB)" for f in biggest))


LIB = ROOT / "lib" / "kvreplay"


def _module_name(path: Path, lib: Path = LIB) -> str:
    parts = path.relative_to(lib.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(lib: Path = LIB) -> dict[str, set[str]]:
    """Edges module -> project module it imports (anywhere in the file), and -> that module's packages
    (importing ``a.b.c`` runs ``a/b/__init__.py`` first), except the importer's own packages (already importing)."""
    import ast

    modules = {_module_name(p, lib): p for p in lib.rglob("*.py") if "__pycache__" not in p.parts}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        own = {".".join(name.split(".")[:i]) for i in range(1, len(name.split(".")))}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):  # import kvreplay.x.y
                candidates = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level == 0:  # from kvreplay.x import y (other packages are not in `modules`)
                    target = node.module or ""
                else:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                candidates = [target] if node.module else []
                candidates += [f"{target}.{a.name}" for a in node.names]  # "from . import x" or "from .pkg import sub"
            else:
                continue
            for c in candidates:
                if c in modules and c != name:
                    ancestors = {".".join(c.split(".")[:i]) for i in range(1, len(c.split(".")))}
                    graph[name] |= {m for m in {c} | ancestors if m in modules and m not in own and m != name}
    return graph


def test_the_library_has_no_import_cycle():
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, bs in import_graph().items() for b in bs])
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_the_import_cycle_check_can_fail(monkeypatch):
    graph = import_graph()
    assert "kvreplay.experiments.matrix" in graph["kvreplay.experiments.bridge"]
    assert "kvreplay.runner" in graph["kvreplay.experiments.matrix"]
    graph["kvreplay.ledger.store"].add("kvreplay.experiments.bridge")  # store -> bridge -> matrix -> runner -> ... -> store
    import networkx as nx

    g = nx.DiGraph([(a, b) for a, bs in graph.items() for b in bs])
    assert any("kvreplay.experiments.bridge" in c for c in nx.simple_cycles(g))


def architecture_layers() -> dict[str, int]:
    """Module -> its layer's row in docs/ARCHITECTURE.md's layer table (0 = core, then upwards); a package's
    ``__init__`` is its modules' layer, and ``kvreplay.ledger.__main__`` the ledger's (it is that package's command)."""
    import re

    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]  # the layer table, not the later ones
    rows = [line for line in section.splitlines()
            if line.startswith("| ") and not line.startswith(("| layer ", "|---"))]
    layers: dict[str, int] = {}
    for i, row in enumerate(rows):
        parent = ""
        for name in re.findall(r"`([\w.]+)`", row.split("|")[2]):
            if name.startswith("."):  # `.matrix` after `experiments.endpoints`
                name = parent + name
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            layers[f"kvreplay.{name}"] = i
    for m in list(layers):
        if m.count(".") > 1:
            layers.setdefault(m.rsplit(".", 1)[0], layers[m])
    layers.setdefault("kvreplay.ledger.__main__", layers.get("kvreplay.ledger", -1))
    return layers


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[tuple[str, str]]:
    """``(importer, imported)`` pairs where the imported module sits on a higher layer (both must be mapped)."""
    return sorted((a, b) for a, bs in graph.items() for b in bs if a in layers and b in layers and layers[b] > layers[a])


def test_imports_only_go_down_the_architecture_layers():
    """docs/ARCHITECTURE.md says nothing imports a layer above it: every module is in its table, and every import
    (module level or inside a function) goes to the same layer or a lower one."""
    layers = architecture_layers()
    graph = import_graph()
    unmapped = sorted(m for m in graph if m != "kvreplay" and m not in layers)
    assert not unmapped, f"modules missing from docs/ARCHITECTURE.md's layer table: {unmapped}"
    assert not set(layers) - set(graph), f"docs/ARCHITECTURE.md lists no such module: {sorted(set(layers) - set(graph))}"
    upward = upward_imports(graph, layers)
    assert not upward, f"imports that go up a layer: {upward}"


def folder_layers(layers: dict[str, int]) -> dict[str, set[int]]:
    """Folder of ``lib/kvreplay`` -> the layers its modules sit on (docs/ARCHITECTURE.md's table)."""
    out: dict[str, set[int]] = {}
    for module, layer in layers.items():
        parts = module.split(".")
        if len(parts) > 2:  # kvreplay.<folder>.<module>
            out.setdefault(parts[1], set()).add(layer)
    return out


def test_each_folder_of_the_library_is_one_layer():
    """The folders show the layers: every module of a folder sits on the same row of the layer table, so a folder's
    imports go down as its modules' do (a module placed in the wrong folder fails here, naming the folder)."""
    folders = folder_layers(architecture_layers())
    assert {"data", "analysis", "model", "decoding", "engine", "ledger", "runner", "experiments", "report", "notebook",
            "bench", "paper"} <= set(folders)
    spread = {f: sorted(v) for f, v in folders.items() if len(v) > 1}
    assert not spread, f"folders whose modules sit on more than one layer: {spread}"
    layers = architecture_layers() | {"kvreplay.model.planted": architecture_layers()["kvreplay.verify"]}
    assert folder_layers(layers)["model"] == {layers["kvreplay.model.models"], layers["kvreplay.verify"]}


def test_the_layer_check_can_fail(tmp_path):
    """An import planted inside a function of a core module, in a copy of the library, is found going up."""
    import shutil

    layers = architecture_layers()
    assert layers["kvreplay.gates"] == 0 and layers["kvreplay.experiments.matrix"] > layers["kvreplay.runner.loop"]
    assert layers["kvreplay.verify"] == max(layers.values())
    lib = tmp_path / "kvreplay"
    shutil.copytree(LIB, lib, ignore=shutil.ignore_patterns("__pycache__"))
    with open(lib / "gates.py", "a") as f:
        f.write("\n\ndef _planted():\n    from .report import files\n    return files\n")
    assert upward_imports(import_graph(lib), layers) == [("kvreplay.gates", "kvreplay.report"),
                                                         ("kvreplay.gates", "kvreplay.report.files")]


def test_every_notebook_has_its_paired_script_and_they_agree():
    """notebooks/X.ipynb and notebooks/py/X.py (jupytext percent format, jupytext.toml) hold the same cells."""
    import jupytext

    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    scripts = sorted((ROOT / "notebooks" / "py").glob("*.py"))
    assert notebooks and [p.stem for p in scripts] == [p.stem for p in notebooks]
    for nb in notebooks:
        want = jupytext.writes(jupytext.read(nb), fmt="py:percent")
        got = (ROOT / "notebooks" / "py" / f"{nb.stem}.py").read_text()
        assert got == want, f"notebooks/py/{nb.stem}.py is not {nb.name} as a script: run `jupytext --sync notebooks/*.ipynb`"


OUTSIDE_REFERENCE = r"\.\./s[h]ared\b|\b(?:D[E]SIGN|P[A]PER|S[T]YLE)\.md\b|\b[Ii]ssues? #?\d+\b"
"""What the repository's text must not contain: pointers to files outside it (the planning notes beside the
checkout) or to tracker issue numbers. The repository explains itself. (The names are spelled with character
classes, and the test below builds its bad line from parts, so that this file holds no such pointer itself.)"""


def outside_references(files: list[Path], root: Path = ROOT) -> list[str]:
    import re

    pattern = re.compile(OUTSIDE_REFERENCE)
    found = []
    for f in files:
        if f.suffix not in {".py", ".md", ".yaml", ".yml", ".ipynb", ".cfg", ".toml", ".sh", ".txt"} and f.name not in {
                "Makefile", "run"}:
            continue
        try:
            text = f.read_text()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for no, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                found.append(f"{f.relative_to(root)}:{no}: {line.strip()[:120]}")
    return found


def test_the_repository_points_to_nothing_outside_it():
    files = [f for f in tracked_files() if f.is_file()]  # this file included: it spells no pointer itself
    assert outside_references(files) == []


def test_the_outside_reference_check_can_fail(tmp_path):
    bad = tmp_path / "note.md"
    bad.write_text("fine line\nsee " + "/".join(["..", "sha" + "red", "DES" + "IGN.md"]) + f" and issue {14}\n")
    assert [x.split(": ")[0] for x in outside_references([bad], tmp_path)] == ["note.md:2"]


README_MAX_LINES = 250
"""The README is a front door read in minutes; everything else lives in docs/."""


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, over {README_MAX_LINES}: move text to docs/"


RUN_HISTORY = (r"\bsessions? [A-Z]\b", r"\bdevice (?:time|sessions?)\b", r"\bcall'?s? (?:time )?limit\b",
               r"\b(?:10|ten)-minute (?:device )?calls?\b", r"\blent\b", r"\blost (?:chunks?|rows?)\b",
               r"\bchunks? (?:was|were) lost\b", r"\b64 MiB\b", r"(?<![\w/.-])20\d\d-\d\d-\d\d(?![\w.-])")
"""Marks of a lab notebook rather than documentation: labels of past device sessions, the limits of a particular
borrowed machine, what a particular run lost, dates of particular runs (a date inside a file name is data, not
prose). A run's history lives in its ledger's run log (`runlog.jsonl`)."""


def run_history(files: list[Path], root: Path = ROOT) -> list[str]:
    """Lines of ``files`` (for YAML files, their comments only) that match a :data:`RUN_HISTORY` pattern."""
    import re

    pattern = re.compile("|".join(RUN_HISTORY), re.I)
    found = []
    for f in files:
        for no, line in enumerate(f.read_text().splitlines(), 1):
            text = line.split("#", 1)[1] if f.suffix == ".yaml" and "#" in line else "" if f.suffix == ".yaml" else line
            if pattern.search(text):
                found.append(f"{f.relative_to(root)}:{no}: {line.strip()[:120]}")
    return found


def test_readme_docs_and_profile_comments_hold_no_run_history():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "notebooks" / "params").glob("*.yaml"))]
    assert run_history(files) == []


def test_the_run_history_check_can_fail(tmp_path):
    (tmp_path / "a.md").write_text("fine\nas planned in session K\nsee bench_2026-12-01.md\non 2026-12-03 it ran\n")
    (tmp_path / "p.yaml").write_text("n_rows: 200  # one lent H200\nnote: session K  \n")
    assert [x.split(": ")[0] for x in run_history([tmp_path / "a.md", tmp_path / "p.yaml"], tmp_path)] == [
        "a.md:2", "a.md:4", "p.yaml:1"]
