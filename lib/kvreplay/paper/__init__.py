"""``make paper``: run every notebook headlessly with papermill, in dependency order.

Usage: ``python -m kvreplay.paper --profile cpu [--only 01]``.

Each notebook runs with two parameters injected: ``profile`` (the name of
``notebooks/params/<profile>.yaml``) and ``overrides`` (``--ledger-root`` and
``--figures-root``, when given). The notebook resolves them into the chain's
parameters (:func:`kvreplay.notebook.profiles.load_parameters`); they are checked here
first, so a bad profile stops before any notebook runs. The executed copy and an HTML rendering go to
``build/<profile>/``; ledgers, tables and figures are written by the
notebooks themselves (``data/ledgers/<profile>/``, ``figures/<profile>/``).
A notebook that fails stops the chain: its partial copy is moved to
``build/<profile>/failed/`` (never left in place of a good one) and the
failing cell is named. The notebooks before it stay done: the same
command resumes at the one that failed (or was interrupted). A notebook whose inputs (source, parameters, library
source, the profile's ledgers) are unchanged since its last successful run is
skipped (the parameters enter as resolved, so editing a profile's value reruns
what reads it); ``--force`` runs it anyway.

For the profiles whose ledgers are committed (:data:`EXECUTED_PROFILES`: ``cpu``, ``gpu``, ``paper``; ``gemma``
once its GPU-computed ledgers are in ``data/ledgers/gemma/``) the executed notebooks are also written to
``executed/<profile>/``, without volatile metadata. They are committed: a reviewer reads them without running
anything. ``executed/<profile>/README.md`` indexes them, linking each table
and figure to the notebook cell that makes it; ``build/<profile>/index.html`` is
the same index for the HTML renderings, which show outputs with the code hidden.
``--executed`` writes them for any profile, ``--no-executed`` for none.

After a run of the profile's notebooks (not ``--only``), :func:`write_results` rewrites its results page from
the ledgers: ``docs/results-<profile>.md`` for the committed profiles (and the README's headline block for
``paper``), ``build/<profile>/results.md`` for any other. For a committed profile it also rewrites
``docs/provenance.md`` and the blocks of the README and ``docs/differences.md`` that
:mod:`kvreplay.report.provenance_pages` generates (counts and provenance of every committed ledger).

While a notebook runs, one progress bar counts its cells; rows that are
computed (not read from a finished ledger) get a row bar with counts below it.

``--engine inprocess`` runs the notebooks' code cells in this Python process
instead of a Jupyter kernel, for machines without Jupyter. Ledgers, tables and figures are written as
usual, but no executed notebook, HTML or up-to-date stamp, so a later
papermill run executes every notebook (reusing the finished ledgers).

The chain and its up-to-date checks are in :mod:`kvreplay.paper.chain`, the executed copies, HTML and index in
:mod:`kvreplay.paper.pages`; both are re-exported here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import yaml

from ..ledger.store import TERMINAL_PROGRESS, library_digest
from ..paths import BUILD, EXECUTED, FIGURES, LEDGERS, NOTEBOOKS, ROOT
from ..notebook.profiles import ChainParameters, describe, load_parameters, profile_path, read_profile
from ..report.files import ARTIFACT_LOG
from ..runner import READ_ONLY_ENV
from ..notebook.session import check_profile_model
from .chain import (  # re-exported
    CHAIN, EXECUTED_PROFILES, RUN_PARAMETERS, assigned_names, code_cells, declared_parameters, inputs_digest,
    notebook_arms, run_inprocess, unfinished_arms,
)
from .pages import (  # re-exported
    EXPLORER, HEADLINE, PROGRESS_BAR, READING_CSS, VOLATILE_METADATA, artifact_index, artifact_log, clean_executed,
    headline, is_progress_output, render_html, write_index,
)


KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=CRITICAL", "--IPKernelApp.capture_fd_output=False"]
"""How ``make paper`` starts a kernel: it logs only critical errors (a kernel shut down by Ctrl-C logs no ZMQ
traceback), and what is written to its file descriptors rather than through ``sys.stdout`` (the row bars drawn
on the terminal, :data:`~kvreplay.ledger.store.TERMINAL_PROGRESS`) goes to the terminal, not into the notebook."""


def copy_artifact_log(src: Path, dest: Path, name: str) -> None:
    """Copy notebook ``name``'s record of its tables and figures (:func:`artifact_log`) from ``src`` to ``dest`` beside
    its executed copy; a notebook that saved none has none there either."""
    if artifact_log(src, name).is_file():
        shutil.copyfile(artifact_log(src, name), artifact_log(dest, name))
    else:
        artifact_log(dest, name).unlink(missing_ok=True)


def run_notebook(name: str, params: dict, out_dir: Path, html: bool = True, progress: bool = True) -> Path:
    """Execute one notebook with papermill into ``out_dir`` (atomically) and render HTML.

    The executed copy is written to a hidden partial file and moved into
    place only when every cell ran, cleaned as :func:`clean_executed` cleans
    the committed copies (paths relative to the repository). On any failure
    (a failing cell, a dead kernel, Ctrl-C) the partial copy goes to
    ``out_dir/failed/`` and any earlier good copy and its HTML are removed,
    so nothing stale stays in place. The kernel logs only critical errors
    (a kernel shut down under Ctrl-C logs no ZMQ traceback).

    Raises:
        RuntimeError: naming the notebook and, for a failing cell, the cell.
    """
    import papermill as pm

    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / name
    tmp = out_dir / f".{Path(name).stem}.partial.ipynb"
    log = artifact_log(out_dir, name)  # the kernel records each table and figure it saves there
    log.unlink(missing_ok=True)
    os.environ[ARTIFACT_LOG] = str(log)
    try:
        pm.execute_notebook(
            str(NOTEBOOKS / name), str(tmp), parameters=declared_parameters(name, params), cwd=str(NOTEBOOKS),
            kernel_name="python3", report_mode=False, extra_arguments=KERNEL_ARGUMENTS,
            progress_bar={"desc": f"{Path(name).stem[:24]:<24}", "leave": True} if progress else False,
        )
    except BaseException as e:
        failed = out_dir / "failed"
        failed.mkdir(exist_ok=True)
        if tmp.exists():
            os.replace(tmp, failed / name)
        out.unlink(missing_ok=True)
        out.with_suffix(".html").unlink(missing_ok=True)
        log.unlink(missing_ok=True)
        if isinstance(e, pm.PapermillExecutionError):
            where = f"cell {e.exec_count} ({e.ename}: {e.evalue})"
        elif isinstance(e, KeyboardInterrupt):
            raise
        else:
            where = f"{type(e).__name__}: {e}"
        raise RuntimeError(f"{name} failed in {where}; executed copy kept at {failed / name}") from None
    clean_executed(tmp, tmp)  # no absolute path of this checkout, run dates or timings in the build copy either
    os.replace(tmp, out)
    html_path = out.with_suffix(".html")
    if html:
        html_path.write_text(render_html(out), encoding="utf-8")
    else:
        html_path.unlink(missing_ok=True)
    return out


def _results_inputs(label: str, ledgers: Path, targets: list[Path]) -> str:
    """sha256 of what a results page reads and writes: the library, the paper's numbers, the profile's ledgers (and
    the cross-hardware setups' when the profile is one of them, and its cross-family partner's; run logs excluded)
    and the files it writes."""
    import hashlib

    from ..report.cross_family import partners
    from ..report.cross_hardware import SETUPS
    from ..report.results import REFERENCE

    h = hashlib.sha256(library_digest().encode() + REFERENCE.read_bytes())
    setups = [p for p, _ in SETUPS]
    names = ([label] + setups if label in setups else [label]) + partners(label)
    for folder in (ledgers.parent / name for name in names):
        for f in sorted(folder.rglob("*")) if folder.is_dir() else ():
            if f.is_file() and f.name != "runlog.jsonl" and not f.name.endswith(".lock") and ".tmp-" not in f.name:
                h.update(str(f.relative_to(ledgers.parent)).encode() + f.read_bytes())
    for t in targets:
        h.update(t.read_bytes() if t.is_file() else b"missing")
    return h.hexdigest()


def write_results(label: str, params: ChainParameters, ledgers: Path) -> str:
    """Rewrite a profile's results page from its ledgers (:mod:`kvreplay.report.results_pages`).

    A committed profile (:data:`EXECUTED_PROFILES`, default ledger root) gets ``docs/results-<profile>.md`` and,
    for :data:`~kvreplay.report.results_pages.HEADLINE_PROFILE`, the README's headline block; any other gets
    ``build/<profile>/results.md``. Skipped while its inputs (:func:`_results_inputs`) are unchanged; a chain
    that is not complete gets no page. :func:`main` calls it after a run of the profile's notebooks, not ``--only``.

    Returns:
        one line saying what was written or skipped, or why no page was made.
    """
    from ..ledger.lookup import MissingLedgerError
    from ..report import results_pages

    committed = label in EXECUTED_PROFILES and params.ledger_root is None
    page = results_pages.page_path(label) if committed else BUILD / label / "results.md"
    readme = committed and label == results_pages.HEADLINE_PROFILE
    targets = [page] + ([ROOT / "README.md"] if readme else [])
    stamp = BUILD / label / ".results.inputs"
    if committed:  # every ledger root's run logs feed it, so it is never skipped (it reads no model: seconds)
        from ..report import provenance_pages
        try:
            provenance_pages.regenerate()
        except (FileNotFoundError, ValueError) as e:
            return f"no provenance page ({e})"
    if stamp.is_file() and stamp.read_text() == _results_inputs(label, ledgers, targets):
        return f"results page up to date: {page}"
    try:
        res = results_pages.profile_results(label, ledgers.parent, **results_pages.profile_stats(label))
        changed = results_pages.regenerate(label, ROOT, res, ledgers.parent, page=page, readme=readme)
    except (MissingLedgerError, ValueError) as e:
        return f"no results page ({e})"
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(_results_inputs(label, ledgers, targets))
    return f"results page: {', '.join(map(str, changed))} rewritten" if changed else f"results page unchanged: {page}"


WAIT_POLICY = "OMP_WAIT_POLICY"
"""OpenMP's wait policy: ``PASSIVE`` (unless set) for the kernels, whose idle threads then sleep instead of spinning
against other jobs; it changes no bit (the golden rows pass under it). The Makefile exports the same."""


def main(argv: list[str] | None = None) -> int:
    """``make paper``; see the module docstring. The environment variables it sets for the notebooks' kernels
    (:data:`~kvreplay.ledger.store.TERMINAL_PROGRESS`, :data:`WAIT_POLICY` when unset, and
    :data:`~kvreplay.runner.READ_ONLY_ENV` for a profile whose file lists ``done:``) are restored when it returns.

    Ctrl-C stops the run with one line (exit 130): the kernel is shut down, finished ledger rows stay (a ledger
    is append-only), and the same command resumes."""
    saved = {k: os.environ.get(k) for k in (TERMINAL_PROGRESS, READ_ONLY_ENV, WAIT_POLICY)}
    os.environ.setdefault(WAIT_POLICY, "PASSIVE")
    try:
        return _main(argv)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _shown_path(path: Path) -> str:
    """A path as printed: relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreplay.paper", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--only", nargs="*", help="notebook name prefixes to run (default: the whole chain)")
    ap.add_argument("--no-html", action="store_true")
    ap.add_argument("--force", action="store_true", help="run every notebook even if its inputs are unchanged")
    ap.add_argument("--ledger-root", default=None, help="write and read ledgers under this folder instead of data/ledgers "
                    "(passed to the notebooks as an override)")
    ap.add_argument("--figures-root", default=None, help="write tables and figures under this folder instead of figures/ "
                    "(passed to the notebooks as an override)")
    ap.add_argument("--executed", action="store_true", help=f"also write executed/<profile>/ (default only for {EXECUTED_PROFILES})")
    ap.add_argument("--no-executed", action="store_true", help="do not write executed/<profile>/")
    ap.add_argument("--engine", choices=["papermill", "inprocess"], default="papermill",
                    help="inprocess: run code cells in this process (no Jupyter; writes no executed notebooks)")
    args = ap.parse_args(argv)
    overrides = {key: str(Path(value).resolve()) for key, value in (("ledger_root", args.ledger_root),
                                                                    ("figures_root", args.figures_root)) if value}
    try:
        params = load_parameters(args.profile, overrides)  # what every notebook resolves, checked before any runs
        doc = read_profile(args.profile)  # its `notebooks` list is this driver's, not a chain parameter
    except (FileNotFoundError, ValueError, yaml.YAMLError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # the model, from its config and tokenizer: refused here, before any notebook writes a file
        checked = check_profile_model(params)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # ModelLoadError, ContractError, a bad problem file
        print(f"error: profile {params.profile!r}: {e}", file=sys.stderr)
        return 2
    # a profile given as a file is passed on as an absolute path (the notebooks run in notebooks/); its label,
    # the file's name, names the build, ledger and figure folders
    path = profile_path(args.profile)
    label = params.profile
    named = not (args.profile.endswith((".yaml", ".yml")) or "/" in args.profile)  # as profile_path tells them apart
    given = args.profile if named else str(path.resolve())
    injected = {"profile": given, "overrides": overrides} | RUN_PARAMETERS
    ledgers = Path(params.ledger_root or LEDGERS) / params.profile
    figures = Path(params.figures_root or FIGURES) / params.profile
    out_dir = BUILD / label
    # a profile may name the notebooks it runs (e.g. a reference run that covered only some experiments)
    listed = doc.get("notebooks")
    selected = args.only or listed
    if not args.only and "notebooks" in doc:
        if not (isinstance(selected, list) and selected and all(isinstance(x, str) and x for x in selected)):
            print(f"error: profile {label!r}: `notebooks` must be a non-empty list of notebook name prefixes "
                  f"such as [\"01\", \"06\"], got {selected!r}", file=sys.stderr)
            return 2
    chain = [n for n in CHAIN if not selected or any(n.startswith(p) for p in selected)]
    if not chain:
        print(f"error: --only / notebooks {selected} matches no notebook of {CHAIN}", file=sys.stderr)
        return 2
    if "done" in doc:  # computed on a GPU across device sessions: read what is there, never compute the rest here
        missing = unfinished_arms(chain, params, ledgers)
        if missing:
            print(f"error: profile {label!r} is computed on a GPU (its file lists `done:`), and these notebooks would "
                  f"compute here: they need arms its ledgers under {ledgers} do not hold in full, or (00) would train "
                  "a checkpoint family. Finish the arms with scripts/gpu_profile.py, or leave the notebooks out "
                  "(`notebooks:` / --only):\n  "
                  + "\n  ".join(missing), file=sys.stderr)
            return 2
        # every arm is complete under some folder; should a notebook build another key (a profile file edited in a
        # way that changes one), its run_arm refuses to compute rather than compute here (kernels inherit this)
        os.environ[READ_ONLY_ENV] = "1"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"== {describe(params, given, overrides)}", flush=True)  # the resolved values, before anything runs
    print(f"== {checked}", flush=True)
    t0 = time.perf_counter()
    if args.engine == "inprocess":
        import matplotlib

        matplotlib.use("Agg")
        name = chain[0]
        try:
            for name in chain:
                t = time.perf_counter()
                print(f"== {name} (profile {label}, in process)", flush=True)
                (out_dir / f".{Path(name).stem}.inputs").unlink(missing_ok=True)
                try:
                    run_inprocess(NOTEBOOKS / name, injected)
                except RuntimeError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 1
                print(f"   done in {time.perf_counter() - t:.0f} s", flush=True)
        except KeyboardInterrupt:
            print(f"\ninterrupted (Ctrl-C) in {name}: the rows it finished are kept in {_shown_path(ledgers)}; "
                  "run the same command again to resume", file=sys.stderr, flush=True)
            return 130
        print(f"\nin-process run ({label}) finished in {time.perf_counter() - t0:.0f} s; ledgers: {ledgers}; "
              f"tables and figures: {figures}")
        return 0

    os.environ[TERMINAL_PROGRESS] = "1"  # kernels inherit it: computed rows get a row bar in this terminal
    executed = (args.executed or label in EXECUTED_PROFILES) and not args.no_executed
    name = chain[0]
    finished: list[str] = []  # run or skipped as up to date in this run, in chain order

    def stamp_finished() -> None:
        # A chain that stops (a failing cell, Ctrl-C) keeps what it finished: each notebook before the one that
        # stopped is stamped against the state now, so the same command skips them and resumes at the one that
        # stopped (a notebook reads only its own and earlier notebooks' ledgers; what the stopped one wrote since
        # is the ledger it resumes).
        for done in finished:
            (out_dir / f".{Path(done).stem}.inputs").write_text(inputs_digest(done, params))

    try:
        for name in chain:
            t = time.perf_counter()
            stamp = out_dir / f".{Path(name).stem}.inputs"
            if not args.force and (out_dir / name).exists() and stamp.exists() and stamp.read_text() == inputs_digest(name, params):
                print(f"== {name}: up to date (source, parameters, library and ledgers unchanged), skipped", flush=True)
                finished.append(name)
                continue
            print(f"== {name} (profile {label})", flush=True)
            stamp.unlink(missing_ok=True)
            try:
                run_notebook(name, injected, out_dir, html=not args.no_html)
            except RuntimeError as e:
                stamp_finished()
                print(f"error: {e}", file=sys.stderr)
                if finished:
                    print(f"the notebooks before it stay done: the same command skips {', '.join(Path(f).stem[:2] for f in finished)} "
                          f"and resumes at {Path(name).stem[:2]}", file=sys.stderr)
                return 1
            print(f"   done in {time.perf_counter() - t:.0f} s", flush=True)
            finished.append(name)
            if executed:
                clean_executed(out_dir / name, EXECUTED / label / name)
                copy_artifact_log(out_dir, EXECUTED / label, name)
    except KeyboardInterrupt:
        stamp_finished()
        print(f"\ninterrupted (Ctrl-C) in {name}: the rows it finished are kept in {_shown_path(ledgers)}; "
              "run the same command again to resume", file=sys.stderr, flush=True)
        return 130
    # Stamp against the final state: a notebook reads only its own and earlier notebooks' ledgers, so the
    # later notebooks' writes do not change its outputs.
    for name in chain:
        (out_dir / f".{Path(name).stem}.inputs").write_text(inputs_digest(name, params))
    entries = artifact_index(out_dir, CHAIN)
    write_index(entries, label, out_dir, out_dir, listed, figures)
    if executed:
        write_index(artifact_index(EXECUTED / label, CHAIN), label, EXECUTED / label, None,
                    listed, figures)
    results_line = ("results page: not rewritten by a run with --only" if args.only
                    else write_results(label, params, ledgers))
    print(f"\nmake paper ({label}) finished in {time.perf_counter() - t0:.0f} s")
    print(f"  executed notebooks and HTML: {out_dir} (index: {out_dir / 'index.html'})")
    if executed:
        print(f"  committed executed copies:   {EXECUTED / label} (index: README.md)")
    print(f"  ledgers:                     {ledgers}")
    print(f"  tables and figures:          {figures}")
    print(f"  {results_line}")
    return 0

