"""The drift explorer's state and controls (notebook 08): ledger rows, rebuilt boundary drift and ipywidgets.

A row's two boundary caches are rebuilt once (minutes: the model loads and replays the prefix). What the explorer
draws from them is kept on disk (:class:`kvreplay.report.rebuild.RebuiltDrift`, a few hundred kB) under
:func:`cache_dir` (``$KVREPLAY_EXPLORER_CACHE``, default ``build/explorer-cache/``). It is keyed by the ledger folder,
the row's digest, the comparison and the row-algorithm and rebuild versions. Committed rebuilds under
:data:`COMMITTED_CACHE` are read too. So any row rebuilt before, in any session, draws in about a second without
loading a model. Per kernel the tokenizer and model of each ledger are kept as well. While a rebuild runs the figure
says so (the previous row's maps are cleared); a slider redraws when released (``continuous_update=False``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import cast

import numpy as np
import pandas as pd

from ..ledger.lookup import LoadedLedger, MissingLedgerError, find_chain_ledger
from ..ledger.records import Exp1Row, Exp2Row, comparison_of
from ..model.models import load_tokenizer
from ..paths import BUILD, DATA
from ..report.rebuild import (
    COMPARISONS,
    RebuiltDrift,
    comparison_arms,
    drift_file,
    drift_key,
    load_drift,
    load_for_ledger,
    model_for_ledger,
    rebuild_pair,
    rebuilt_drift,
    save_drift,
)
from ..report import figures
from ..report.frames import layer_drift_frame

PRECISIONS = ("bfloat16", "float32")

CACHE_ENV = "KVREPLAY_EXPLORER_CACHE"
"""Environment variable naming the folder of rebuilt rows (default ``build/explorer-cache``)."""

COMMITTED_CACHE = DATA / "explorer"
"""Rebuilt rows committed with the repository (read, never written by the explorer): what the executed copies of
notebook 08 draw without loading a model."""

_MODELS: dict = {}
_TOKENIZERS: dict = {}
_DRIFTS: dict = {}
_ORIGINS: dict[str, Path | None] = {}  # a drift's digest -> the file it was read from (None: rebuilt in this kernel)


def cache_dir() -> Path:
    """Where rebuilt rows are written and first looked for: ``$KVREPLAY_EXPLORER_CACHE`` or ``build/explorer-cache``."""
    return Path(os.environ.get(CACHE_ENV) or BUILD / "explorer-cache")


def _model_key(ledger: LoadedLedger, model: str | None) -> tuple:
    c = ledger.config
    role = (c.get("role_table") or {}).get("sha256")
    return (model_for_ledger(ledger, model), c["dtype"], role, c["threads"], tuple(c["sdpa_backends"]),
            ledger.contract.get("format_digest"))


def model_for(ledger: LoadedLedger, model: str | None = None):
    """The ledger's model and block format, loaded once per kernel (:func:`kvreplay.report.rebuild.load_for_ledger`).

    Returns:
        ``(LoadedModel, BlockFormat)``.

    Raises:
        as :func:`kvreplay.report.rebuild.load_for_ledger`.
    """
    key = _model_key(ledger, model)
    if key not in _MODELS:
        _MODELS[key] = load_for_ledger(ledger, model)
    return _MODELS[key]


def tokenizer_for(ledger: LoadedLedger, model: str | None = None):
    """The ledger's tokenizer alone (no weights), loaded once per kernel; the loaded model's if there is one."""
    key = _model_key(ledger, model)
    if key in _MODELS:
        return _MODELS[key][0].tokenizer
    name = model_for_ledger(ledger, model)
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = load_tokenizer(name)
    return _TOKENIZERS[name]


def cached(ledger: LoadedLedger, row: Exp1Row | Exp2Row, comparison: str, model: str | None = None) -> RebuiltDrift | None:
    """The rebuilt drift of ``row`` for ``comparison`` if it was rebuilt before: in this kernel, in :func:`cache_dir`
    or in :data:`COMMITTED_CACHE` (in that order); ``None`` otherwise. Loads no model.

    Raises:
        ValueError: a cache file of the right name that is not a readable rebuild of this version (names it).
    """
    key = drift_key(ledger, row, comparison, model)
    if key["digest"] in _DRIFTS:
        return _DRIFTS[key["digest"]]
    for folder in (cache_dir(), COMMITTED_CACHE):
        path = drift_file(folder, key)
        if path.is_file():
            drift = load_drift(path)
            _DRIFTS[key["digest"]] = drift
            _ORIGINS[key["digest"]] = path
            return drift
    return None


def _shown(path: Path) -> str:
    from ..paths import ROOT

    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


STALE_CSS = (".kvreplay-explorer img.kvreplay-stale { opacity: 0.3; filter: grayscale(1); outline: 3px dashed #d08000; }"
             " .kvreplay-status-stale { color: #b06000; font-weight: bold; }")
"""How the explorer shows a figure that a pending redraw will replace: faded, grey, outlined; its status in orange."""


def html_text(text: str) -> str:
    """``text`` escaped for an HTML widget."""
    import html

    return html.escape(text)


def origin(drift: RebuiltDrift) -> str:
    """Where a drawn row comes from, in words: a committed rebuild (:data:`COMMITTED_CACHE`), the cache of rebuilt rows
    (a file of :func:`cache_dir`) or a rebuild in this kernel, with the machine and the seconds that rebuild took."""
    made = (f"rebuilt on {drift.environment.get('device_name', '?')} in {drift.seconds['rebuild']:.1f} s "
            f"(model load {drift.seconds['model']:.1f} s)")
    path = _ORIGINS.get(drift.key["digest"])
    if path is None:
        return f"{made} in this session"
    if Path(path).resolve().is_relative_to(COMMITTED_CACHE.resolve()):
        return f"a committed rebuild ({_shown(path)}), {made} where its ledger was computed; nothing rebuilt here"
    return f"read from the cache of rebuilt rows ({_shown(path)}), {made} earlier; nothing rebuilt now"


def same_environment(drift: RebuiltDrift, ledger: LoadedLedger) -> bool:
    """Whether ``drift`` was rebuilt with the ledger's machine and software: torch, transformers, device name, threads,
    SDPA backends, dtype and the model's weights digest (where they all agree the rebuild must equal the ledger)."""
    here, there = drift.environment, ledger.contract
    return all(here.get(k) == there.get(k) for k in ("torch", "transformers", "device_name", "intra_op_threads",
                                                      "sdpa_backends_used", "dtype")) \
        and here.get("model", {}).get("weights_sha256") == there.get("model", {}).get("weights_sha256")


FINGERPRINT_PARTS = {"cache": "whole-cache summary (exact, relative L2, max |Δ|, differing elements)",
                     "logits": "boundary logits (argmax, top-5, top-1 minus top-2 margins, max |Δ|)",
                     "tensors": "per-layer K/V drift"}
"""What :func:`kvreplay.report.rebuild.fingerprint_matches` compares, part by part, between a rebuild and its ledger row."""


def equality_line(drift: RebuiltDrift, ledger: LoadedLedger) -> str:
    """One sentence: what of the row was compared with its ledger (:data:`FINGERPRINT_PARTS`), which parts are equal,
    and, where some differ, why they may: the ledger's machine and software against the rebuild's."""
    fp = drift.fingerprint
    parts = "; ".join(f"{FINGERPRINT_PARTS.get(k, k)}: {'equal' if ok else 'differs'}" for k, ok in fp.items())
    line = f"rebuilt values against the ledger row's ({parts})"
    if all(fp.values()):
        return line + ": the rebuild reproduces the ledger bit for bit"
    there, here = ledger.contract, drift.environment
    if same_environment(drift, ledger):
        return line + ": the same machine and software as the ledger, so this is a failure to reproduce it"
    return (line + f". The ledger was written on {there.get('device_name', '?')} (torch {there.get('torch', '?')}, "
            f"{there.get('intra_op_threads', '?')} threads), the rebuild ran on {here.get('device_name', '?')} (torch "
            f"{here.get('torch', '?')}, {here.get('intra_op_threads', '?')} threads): another CPU kind or software runs "
            "other BF16 and FP32 kernels, whose last bits differ, so the rebuilt values need not equal the ledger's")


def largest_view(drift: RebuiltDrift, kind: str = "key") -> tuple[int, int] | None:
    """``(layer, KV head)`` of the largest drift of ``kind`` in ``drift`` (per head, over positions); ``None`` where the
    row's two caches are bit-exact in every layer and head."""
    m = np.nan_to_num(drift.maps[(kind, "head")].to_numpy().astype(np.float64), nan=0.0)
    if not (m > 0).any():
        return None
    layer, head = np.unravel_index(int(np.argmax(m)), m.shape)
    return int(layer), int(head)


def suffix_table(tokenizer, row: Exp1Row | Exp2Row, ref: str, other: str, before: int = 4, after: int = 8) -> tuple[str, pd.DataFrame]:
    """The two suffixes of a row's arms side by side, from ``before`` tokens before the step where they first differ
    to ``after`` tokens past it (the first ``before + after + 1`` steps when they never differ).

    Returns:
        ``(heading, frame)``: a line naming where they part; a frame with one row per arm (``ref``, ``other``,
        ``same``) and one column per suffix step (token text, whitespace shown as escapes).
    """
    from ..experiments.endpoints import first_divergence
    from ..ledger.records import arm_of
    from ..report.rebuild import suffix_alignment

    a, b = arm_of(row, ref), arm_of(row, other)
    first = first_divergence(a["suffix"], b["suffix"])
    aligned = suffix_alignment(tokenizer, a["suffix"], b["suffix"], a["margins"], b["margins"], first,
                               before=before, after=after)
    frame = aligned[["reference", "other", "same"]].rename(columns={"reference": ref, "other": other}).T
    frame.columns = [f"step {i}" for i in frame.columns]
    heading = (f"suffixes identical ({len(a['suffix'])} tokens)" if first is None else
               f"suffixes part at step {first} after the boundary (predicted answers: {ref} {a['predicted']}, "
               f"{other} {b['predicted']})")
    return heading, frame


def committed_example(ledger_key: str, comparison: str, profile: str = "cpu") -> RebuiltDrift | None:
    """A committed rebuild (:data:`COMMITTED_CACHE`) of ``profile``'s ``ledger_key`` (e.g. ``exp1-bfloat16``) and
    ``comparison``: what a notebook can draw for a reader when its own row has no rebuild here (its ledger computed
    on a GPU); ``None`` when there is none."""
    folder = COMMITTED_CACHE / profile
    paths = sorted(folder.glob(f"*_{ledger_key}-*_{comparison}_*.npz")) if folder.is_dir() else []
    return load_drift(paths[0]) if paths else None


def rebuild(ledger: LoadedLedger, row: Exp1Row | Exp2Row, comparison: str, model: str | None = None,
            progress=None, *, into: str | Path | None = None) -> RebuiltDrift:
    """The rebuilt drift of ``row`` for ``comparison``: :func:`cached` if there is one, else rebuilt from the row's
    prefix z with the ledger's model (:func:`kvreplay.report.rebuild.rebuild_pair`) and written to ``into`` (default
    :func:`cache_dir`).

    Args:
        ledger: the row's ledger (Experiment 1 or 2).
        row: the ledger record (one that passed every gate).
        comparison: a key of ``row["boundary"]`` (see :data:`kvreplay.report.rebuild.COMPARISONS`).
        model: overrides the ledger's model path (local folders).
        progress: optional callable ``(step: int, of: int, what: str)`` told before each stage.
        into: the folder the rebuilt row is written to.

    Raises:
        GateError, ModelLoadError, DeviceUnavailableError, ContractError: as :func:`kvreplay.report.rebuild.rebuild_pair`.
    """
    found = cached(ledger, row, comparison, model)
    tell = progress or (lambda *a: None)
    if found is not None:
        tell(4, 4, "read from the cache of rebuilt rows")
        return found
    experiment = ledger.key.split("-")[0]
    ref_arm, other_arm = comparison_arms(experiment, comparison)
    t0 = time.perf_counter()
    was_loaded = _model_key(ledger, model) in _MODELS
    tell(0, 4, "model cached" if was_loaded else "loading the ledger's model")
    lm, fmt = model_for(ledger, model)
    t1 = time.perf_counter()
    tell(1, 4, f"rebuilding {ref_arm} and {other_arm} from z ({len(row['prefix'])} tokens)")
    a, b = rebuild_pair(lm, fmt, row["prefix"], ref_arm, other_arm, where=row["problem_id"])
    tell(2, 4, "comparing the two caches; drift per head and position")
    drift = rebuilt_drift(lm, fmt, ledger, row, comparison, a, b, model=model,
                          seconds={"model": 0.0 if was_loaded else t1 - t0, "rebuild": time.perf_counter() - t1})
    tell(3, 4, "writing the rebuilt row to the cache")
    save_drift(drift, drift_file(Path(into) if into is not None else cache_dir(), drift.key))
    _DRIFTS[drift.key["digest"]] = drift
    _ORIGINS[drift.key["digest"]] = None
    tell(4, 4, "done")
    return drift


def head_position_drift(drift: RebuiltDrift, layer: int, head: int, kind: str) -> np.ndarray:
    """Relative L2 drift per position of one layer, KV head and kind (over head_dim), float64 ``[|z|]``; NaN where
    the reference is 0."""
    return drift.detail[kind][layer, head].astype(np.float64)


def largest_drift(drift: RebuiltDrift, layer: int, head: int, kind: str, n: int = 12) -> pd.DataFrame:
    """The ``n`` positions of z with the largest drift of one layer, KV head and kind, with their token text and block.

    Returns:
        DataFrame indexed by ``position``: ``token``, ``block``, ``relative L2``; largest first (none where all 0).
    """
    d = head_position_drift(drift, layer, head, kind)
    starts = sorted(drift.blocks.items(), key=lambda kv: kv[1])
    order = [p for p in np.argsort(-np.nan_to_num(d, nan=-1.0), kind="stable")[:n] if np.nan_to_num(d[p]) > 0]
    rows = [{"position": int(p), "token": drift.tokens[p],
             "block": next((name for name, s in reversed(starts) if s <= p), ""), "relative L2": float(d[p])}
            for p in order]
    return pd.DataFrame(rows, columns=["position", "token", "block", "relative L2"]).set_index("position")


def zoom(fig, tokens: list[str], window: tuple[int, int] | None, max_labels: int = 40) -> None:
    """Show positions ``window = (first, last)`` of z on a figure's position axes (those titled "... per position"),
    with token-text labels, every position's once at most ``max_labels`` are shown (``None``: all of z)."""
    lo, hi = window if window is not None else (0, len(tokens) - 1)
    for ax in fig.axes:
        if "per position" in ax.get_title(loc="left"):
            ax.set_xlim(lo - 0.5, hi + 0.5)
            figures.token_ticks(ax, tokens, lo, hi + 1, max_labels=max_labels)
            for text in ax.texts:  # block names outside the window would stretch the layout
                x = text.xy[0] if hasattr(text, "xy") else text.get_position()[0]  # an annotation: its anchor
                text.set_visible(lo - 0.5 <= x <= hi + 0.5)


def png_bytes(fig, dpi: int = 80) -> bytes:
    """A figure as PNG bytes at ``dpi``: independent of the kernel's matplotlib backend. The explorer's figures are
    made without pyplot (:mod:`kvreplay.report.explorer_figures`); one pyplot made is closed afterwards."""
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    if getattr(fig.canvas, "manager", None) is not None:  # a pyplot figure: release it from pyplot's registry
        import matplotlib.pyplot as plt

        plt.close(fig)
    return buf.getvalue()


def as_png(fig, dpi: int = 80):
    """A figure as an inline PNG image at ``dpi`` (closed afterwards): :func:`png_bytes` for ``display``."""
    from IPython.display import Image

    return Image(data=png_bytes(fig, dpi), format="png")


def row_status(row: dict, comparison: str, pair: tuple[str, str] | None = None) -> str:
    """One line naming a row and its outcome for an arm pair: where its two suffixes first differ (or the same suffix)
    and whether the comparison's cache is exact.

    Args:
        row: a ledger record.
        comparison: a key of ``row["boundary"]``.
        pair: ``(reference arm, other arm)`` whose suffixes are compared; ``None``: the row's endpoints (prefill vs live).
    """
    if row.get("gate_failure"):
        return f"{row['problem_id']} · gate failed ({row['gate_failure'].get('gate')})"
    if pair is not None:
        from ..experiments.endpoints import first_divergence
        from ..ledger.records import arm_of

        rec = cast("Exp1Row | Exp2Row", row)  # a ledger record, read as the ledger stores it
        fd = first_divergence(arm_of(rec, pair[0])["suffix"], arm_of(rec, pair[1])["suffix"])
        differs = fd is not None
    else:
        ep = row.get("endpoints", {})
        fd, differs = ep.get("first_divergence"), ep.get("suffix_differs")
    suffix = f"diverges at token {fd}" if differs else "same suffix"
    cache = row.get("boundary", {}).get(comparison, {}).get("cache", {})
    exact = "cache exact" if cache.get("exact") else f"cache differs (rel L2 {cache.get('rel_l2', float('nan')):.2g})"
    return f"{row['problem_id']} · {suffix} · {exact}"


def available_pairs(ledger_root: str | Path, profile: str) -> dict[str, tuple[LoadedLedger, str]]:
    """Every (experiment, precision, comparison) whose finished ledger exists for the profile.

    Returns:
        label (e.g. ``"exp1 bfloat16: prefill vs live"``) -> ``(ledger, comparison)``; empty if none.
    """
    out = {}
    for experiment, comps in COMPARISONS.items():
        for precision in PRECISIONS:
            try:
                ledger = find_chain_ledger(ledger_root, profile, f"{experiment}-{precision}")
            except (MissingLedgerError, KeyError):
                continue
            for comp, (ref, other) in comps.items():
                out[f"{experiment} {precision}: {other} vs {ref}"] = (ledger, comp)
    return out


class Explorer:
    """The interactive explorer: an arm-pair picker, a row picker, layer and head sliders, a K/V switch and a position
    window.

    ``Explorer(ledger_root, profile).widget`` is an ipywidgets box; display it in a notebook. Picking a row or pair
    draws it from the cache of rebuilt rows (:func:`cached`) within about a second, or rebuilds it (minutes, with a
    progress bar; the figure says "Rebuilding" meanwhile, the previous row's maps hidden). A new row opens at the
    layer and KV head of its largest key drift (:func:`largest_view`; a bit-exact row says so). Sliders and switches
    redraw from the cached drift, a slider when released (``continuous_update=False``). Every figure and table is
    a widget's value (an ``Image``, ``HTML``), never output captured into an ``Output`` area, so a change made
    while an earlier draw or Run All is still going cannot send a figure elsewhere. The status line says where the
    row comes from (:func:`origin`) and what was compared with the ledger (:func:`equality_line`); below the
    figure, the positions of largest drift and the two suffixes from a few tokens before they part
    (:func:`suffix_table`). ``last_draw_s`` holds the last redraw's wall time.

    Raises:
        MissingLedgerError: if the profile has no Experiment 1 or 2 ledger.
    """
    def __init__(self, ledger_root: str | Path, profile: str, *, model: str | None = None, pair: str | None = None,
                 problem: str | None = None):
        import ipywidgets as w

        self.model = model
        self.pairs = available_pairs(ledger_root, profile)
        if not self.pairs:
            raise MissingLedgerError(
                f"no Experiment 1 or 2 ledger for profile {profile!r} under {ledger_root}; run notebooks 01 and 02 "
                f"(make paper PROFILE={profile}) or pick a profile with committed ledgers")
        self.last_draw_s: float | None = None
        self._quiet = False  # no redraws while a refresh resets the controls
        self.pair_picker = w.Dropdown(options=list(self.pairs), value=pair if pair in self.pairs else next(iter(self.pairs)),
                                      description="arm pair", layout=w.Layout(width="460px"))
        self.row_picker = w.Dropdown(description="row", layout=w.Layout(width="640px"))
        self.layer = w.IntSlider(description="layer", min=0, max=1, continuous_update=False)
        self.head = w.IntSlider(description="KV head", min=0, max=1, continuous_update=False)
        self.window = w.IntRangeSlider(description="positions", min=0, max=1, value=(0, 1), continuous_update=False,
                                       layout=w.Layout(width="640px"))
        self.kind = w.ToggleButtons(options=["key", "value"], description="K / V")
        self.progress = w.IntProgress(min=0, max=4, description="rebuild", layout=w.Layout(width="460px"))
        self.status = w.HTML()
        self.source = w.HTML()  # where the row comes from and what was compared with the ledger
        self.summary_note = w.HTML()
        self.summary_image = w.Image(format="png", layout=w.Layout(width="100%", max_width="1100px"))
        self.notice = w.HTML()  # "Rebuilding ..." while a rebuild runs
        self.figure = w.Image(format="png", layout=w.Layout(width="100%", max_width="1300px"))
        self.figure.add_class("kvreplay-figure")
        self.largest = w.HTML()
        self.suffixes = w.HTML()
        self.suffixes.add_class("kvreplay-suffixes")
        self.style = w.HTML(f"<style>{STALE_CSS}</style>")  # how a figure marked stale looks
        self._fill_rows(problem)
        self.pair_picker.observe(self._on_pair, names="value")
        self.row_picker.observe(self._on_row, names="value")
        for c in (self.layer, self.head, self.kind, self.window):
            c.observe(self._on_view, names="value")
        self.widget = w.VBox([
            w.HBox([self.pair_picker, self.kind]), self.row_picker, w.HBox([self.layer, self.head]), self.window,
            w.HBox([self.progress, self.status]), self.source, self.summary_note, self.summary_image, self.notice,
            self.figure, self.largest, self.suffixes, self.style,
        ])
        self.widget.add_class("kvreplay-explorer")

    # -- state
    @property
    def ledger(self) -> LoadedLedger:
        return self.pairs[self.pair_picker.value][0]

    @property
    def comparison(self) -> str:
        return self.pairs[self.pair_picker.value][1]

    @property
    def row(self) -> Exp1Row | Exp2Row:
        """The picked row (the picker lists only rows that passed every gate)."""
        return next(r for r in self.ledger.records if r["problem_id"] == self.row_picker.value)

    def _fill_rows(self, problem: str | None = None) -> None:
        keep = problem or self.row_picker.value
        recs = [r for r in self.ledger.records if not r.get("gate_failure")]
        pair = comparison_arms(self.ledger.key.split("-")[0], self.comparison)  # labels follow the picked arm pair
        options = [(row_status(r, self.comparison, pair), r["problem_id"]) for r in recs]
        ids = [v for _, v in options]
        first_div = next((v for label, v in options if "diverges at token" in label), ids[0] if ids else None)
        self.row_picker.options = options  # resets the value to the first option; observers are quiet here
        self.row_picker.value = keep if keep in ids else first_div

    # -- events
    def _on_pair(self, _change) -> None:
        self._quiet = True
        try:
            self._fill_rows()
        finally:
            self._quiet = False
        self.refresh()

    def _on_row(self, _change) -> None:
        if not self._quiet:
            self.refresh()

    def _on_view(self, _change) -> None:
        if not self._quiet:
            self.draw()

    def _tell(self, step: int, of: int, what: str) -> None:
        self.progress.max = of
        self.progress.value = step
        self.status.value = f"<span>{what}</span>"

    # -- drawing
    def refresh(self) -> None:
        """Show the ledger's per-layer summary of the current row and its two suffixes, then draw its rebuilt drift:
        from the cache, or rebuilt (the figure marked as rebuilding until then), at its layer and head of largest
        drift."""
        import html

        row, comp = self.row, self.comparison
        ref, other = comparison_arms(self.ledger.key.split("-")[0], comp)
        self._mark_stale(f"{row['problem_id']} ({other} vs {ref})")
        self._fit_sliders(row)  # the new row's ranges before anything of it draws
        summary = comparison_of(row, comp)
        if "tensors" in summary:
            fig = figures.explorer_layers(layer_drift_frame(summary["tensors"]),
                                          title=f"{row['problem_id']}: {other} vs {ref}, {self.ledger.config['dtype']} (ledger)")
            self.summary_image.value = png_bytes(fig)
            self.summary_image.layout.display = None
            self.summary_note.value = ""
        else:
            self.summary_image.layout.display = "none"
            self.summary_note.value = (f"<p>the ledger keeps only the whole-cache summary for {comp} "
                                       f"(exact: {summary['cache']['exact']})</p>")
        heading, frame = suffix_table(tokenizer_for(self.ledger, self.model), row, ref, other)
        self.suffixes.value = (f"<p><b>The two suffixes</b>, {html.escape(heading)}:</p>"
                               + frame.to_html(escape=True, border=0))
        drift = cached(self.ledger, row, comp, self.model)
        if drift is None:  # minutes: say so where the figure is, so the previous row's maps are not read as this one's
            self.figure.layout.display = "none"
            self.largest.value = ""
            self.source.value = ""
            self.notice.value = (f"<p class='kvreplay-stale'><b>Rebuilding {row['problem_id']}</b> ({other} vs {ref}, "
                                 f"{self.ledger.config['dtype']}, |z| = {len(row['prefix'])} tokens): the model loads "
                                 "and both caches are rebuilt once; later draws of this row read the cache.</p>")
            self.status.value = "<span class='kvreplay-status-stale'>rebuilding</span>"
            drift = rebuild(self.ledger, row, comp, self.model, progress=self._tell)
        else:
            self._tell(4, 4, "read from the cache of rebuilt rows")
        n_layers, n_heads = drift.maps[("key", "head")].shape
        n = len(drift.tokens)
        at = largest_view(drift, self.kind.value) or (0, 0)
        self._set_ranges(n_layers, n_heads, n, at)
        self.draw()

    def _set_ranges(self, n_layers: int, n_heads: int, n: int, at: tuple[int, int] = (0, 0)) -> None:
        """Slider ranges for ``n_layers`` layers, ``n_heads`` KV heads and ``n`` positions, at ``at``; no redraw."""
        self._quiet = True
        try:
            self.layer.max, self.head.max = max(1, n_layers - 1), max(1, n_heads - 1)
            self.layer.value, self.head.value = at
            self.window.max = max(1, n - 1)
            self.window.value = (0, max(1, n - 1))
        finally:
            self._quiet = False

    def _fit_sliders(self, row) -> None:
        """Give the sliders the row's ranges from its ledger (|z|, the model's layers and KV heads) before it draws."""
        model = self.ledger.contract.get("model", {})
        layers, heads = model.get("layers"), model.get("kv_heads")
        if layers and heads:
            self._set_ranges(int(layers), int(heads), len(row["prefix"]))

    def _mark_stale(self, what: str) -> None:
        """Mark the figure shown as the previous view's until the next one replaces it (status and a faded figure)."""
        self.figure.add_class("kvreplay-stale")
        self.status.value = f"<span class='kvreplay-status-stale'>updating: {html_text(what)}; the figure below is the previous view</span>"

    def draw(self) -> None:
        """Redraw the heatmaps, the selected layer/head's per-position drift and its largest positions from the cached
        drift (nothing while the current row is being rebuilt)."""
        import html

        t0 = time.perf_counter()
        row, comp = self.row, self.comparison
        drift = cached(self.ledger, row, comp, self.model)
        if drift is None:
            return
        ref, other = comparison_arms(self.ledger.key.split("-")[0], comp)
        self._mark_stale(f"{row['problem_id']}, layer {self.layer.value}, KV head {self.head.value}, {self.kind.value}s")
        layer, head, kind = self.layer.value, self.head.value, self.kind.value
        exact = largest_view(drift, kind) is None
        detail = head_position_drift(drift, layer, head, kind)
        fig = figures.explorer_view(drift.maps, detail, drift.tokens, drift.blocks, layer=layer, head=head, kind=kind,
                                    title=f"{row['problem_id']}: {other} vs {ref}, {self.ledger.config['dtype']}"
                                    + (f": bit-exact ({kind}s equal in every layer, head and position)" if exact else ""))
        lo, hi = self.window.value
        zoom(fig, drift.tokens, (lo, hi) if (lo, hi) != (0, len(drift.tokens) - 1) else None)
        self.figure.value = png_bytes(fig)
        self.figure.layout.display = None
        self.figure.remove_class("kvreplay-stale")
        self.notice.value = ""
        top = largest_drift(drift, layer, head, kind)
        self.largest.value = (f"<p>positions of largest drift, layer {layer}, KV head {head}, {kind}s"
                              + (": none (bit-exact)</p>" if not len(top) else "</p>" + top.to_html(escape=True, border=0)))
        self.last_draw_s = time.perf_counter() - t0
        self.source.value = (f"<span class='kvreplay-source'>{html.escape(origin(drift))} · "
                             f"{html.escape(equality_line(drift, self.ledger))}</span>")
        self.status.value = (f"<span class='kvreplay-status'>drawn in {self.last_draw_s:.2f} s · {row['problem_id']} · "
                             f"layer {layer}, KV head {head}, {kind}s" + (" · bit-exact" if exact else "") + "</span>")

    def show(self):
        """Display the controls and draw the current row (rebuilding it if needed); returns the widget."""
        from IPython.display import display

        display(self.widget)
        self.refresh()
        return self.widget


def rows_frame(ledger: LoadedLedger, comparison: str) -> pd.DataFrame:
    """The rows of a ledger with their divergence status (the list the row picker offers).

    Returns:
        DataFrame indexed by ``problem_id``: ``suffix differs``, ``first divergence``, ``cache exact``,
        ``cache rel L2``, ``gate failure``.
    """
    out = []
    for r in ledger.records:
        ep = r.get("endpoints", {})
        cache = r.get("boundary", {}).get(comparison, {}).get("cache", {})
        out.append({"problem_id": r["problem_id"], "suffix differs": ep.get("suffix_differs"),
                    "first divergence": ep.get("first_divergence"), "cache exact": cache.get("exact"),
                    "cache rel L2": cache.get("rel_l2"), "gate failure": (r.get("gate_failure") or {}).get("gate")})
    return pd.DataFrame(out).set_index("problem_id")
