"""The drift explorer's state and controls (notebook 08): ledger rows, rebuilt caches and ipywidgets.

Everything expensive is cached per kernel (module-level dictionaries): the
tokenizer and the model of each ledger (keyed by model, dtype, role table and
threads), and the two rebuilt boundary states of each (ledger, row,
comparison) with their drift maps. Moving a layer or head slider or the K/V
switch only redraws from those caches; picking another row or arm pair
rebuilds that pair once, with a progress bar.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from .contract import ROLE_NAMES
from .experiments.matrix import comparison as compare_states
from .gates import cache_tensors
from .ledger.lookup import LoadedLedger, MissingLedgerError, find_chain_ledger
from .ledger.records import Exp1Row, Exp2Row, comparison_of
from .models import load_tokenizer
from .rebuild import (
    COMPARISONS,
    comparison_arms,
    drift_maps,
    fingerprint_matches,
    load_for_ledger,
    model_for_ledger,
    rebuild_pair,
    token_text,
)
from .report import figures
from .report.frames import layer_drift_frame

if TYPE_CHECKING:
    from .decode import Boundary

PRECISIONS = ("bfloat16", "float32")

_MODELS: dict = {}
_TOKENIZERS: dict = {}
_PAIRS: dict = {}


def _model_key(ledger: LoadedLedger, model: str | None) -> tuple:
    c = ledger.config
    role = (c.get("role_table") or {}).get("sha256")
    return (model_for_ledger(ledger, model), c["dtype"], role, c["threads"], tuple(c["sdpa_backends"]),
            ledger.contract.get("format_digest"))


def model_for(ledger: LoadedLedger, model: str | None = None):
    """The ledger's model and block format, loaded once per kernel (:func:`kvreplay.rebuild.load_for_ledger`).

    Returns:
        ``(LoadedModel, BlockFormat)``.

    Raises:
        as :func:`kvreplay.rebuild.load_for_ledger`.
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


@dataclasses.dataclass
class RebuiltPair:
    """Two rebuilt boundary states of one row and comparison, and what the explorer draws from them.

    Attributes:
        ref, other: :class:`~kvreplay.decode.Boundary` states (caches ``[2, kv_heads, |z|, head_dim]`` per layer).
        tensors: ``(ref inventory, other inventory)`` from :func:`kvreplay.gates.cache_tensors`.
        maps: :func:`kvreplay.rebuild.drift_maps` (per head and per position, keys and values).
        summary: :func:`kvreplay.experiments.matrix.comparison` of the pair (per tensor).
        fingerprint: :func:`kvreplay.rebuild.fingerprint_matches` against the ledger's summary.
        tokens: token text of each position of z.
        blocks: block name -> first position in z.
        seconds: ``{"model": s, "rebuild": s}`` wall times (model 0 when it was cached).
    """
    ref: Boundary
    other: Boundary
    tensors: tuple
    maps: dict
    summary: dict
    fingerprint: dict
    tokens: list[str]
    blocks: dict[str, int]
    seconds: dict[str, float]


def rebuild(ledger: LoadedLedger, row: Exp1Row | Exp2Row, comparison: str, model: str | None = None,
            progress=None) -> RebuiltPair:
    """Rebuild (or return the cached) boundary pair of ``row`` for ``comparison``.

    Args:
        ledger: the row's ledger (Experiment 1 or 2).
        row: the ledger record (one that passed every gate).
        comparison: a key of ``row["boundary"]`` (see :data:`kvreplay.rebuild.COMPARISONS`).
        model: overrides the ledger's model path (local folders).
        progress: optional callable ``(step: int, of: int, what: str)`` told before each stage.

    Raises:
        GateError, ModelLoadError, DeviceUnavailableError, ContractError: as :func:`kvreplay.rebuild.rebuild_pair`.
    """
    key = (str(ledger.dir), row["problem_id"], comparison, model)
    if key in _PAIRS:
        return _PAIRS[key]

    tell = progress or (lambda *a: None)
    experiment = ledger.key.split("-")[0]
    ref_arm, other_arm = comparison_arms(experiment, comparison)
    t0 = time.perf_counter()
    cached = _model_key(ledger, model) in _MODELS
    tell(0, 4, "model cached" if cached else "loading the ledger's model")
    lm, fmt = model_for(ledger, model)
    t1 = time.perf_counter()
    tell(1, 4, f"rebuilding {ref_arm} and {other_arm} from z ({len(row['prefix'])} tokens)")
    a, b = rebuild_pair(lm, fmt, row["prefix"], ref_arm, other_arm, where=row["problem_id"])
    tell(2, 4, "comparing the two caches")
    summary = compare_states(a, b, per_tensor=True)
    inv = (cache_tensors(a.cache), cache_tensors(b.cache))
    tell(3, 4, "drift maps per head and position")
    maps = drift_maps(*inv)
    roles = fmt.parse(row["prefix"]).roles
    blocks = {ROLE_NAMES[r]: list(roles).index(r) for r in sorted(set(roles))}
    tokens = [token_text(lm.tokenizer, t) for t in row["prefix"]]
    pair = RebuiltPair(a, b, inv, maps, summary, fingerprint_matches(comparison_of(row, comparison), summary),
                       tokens, blocks, {"model": 0.0 if cached else t1 - t0, "rebuild": time.perf_counter() - t1})
    tell(4, 4, "done")
    _PAIRS[key] = pair
    return pair


def head_position_drift(pair: RebuiltPair, layer: int, head: int, kind: str, row: int = 0) -> np.ndarray:
    """Relative L2 drift per position of one layer, KV head and kind (over head_dim), float64 ``[|z|]``; NaN where the reference is 0."""
    import torch

    name = f"L{layer:02d}.{kind}"
    a = dict(pair.tensors[0])[name][row, head].detach().to(torch.float64)  # [|z|, head_dim]
    b = dict(pair.tensors[1])[name][row, head].detach().to(torch.float64)
    num = torch.linalg.vector_norm(b - a, dim=-1)
    den = torch.linalg.vector_norm(a, dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, math.nan)).numpy()


def _png(fig, dpi: int = 80):
    """A figure as an inline PNG image (closed afterwards): independent of the kernel's matplotlib backend."""
    import io

    import matplotlib.pyplot as plt
    from IPython.display import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return Image(data=buf.getvalue(), format="png")


def row_status(row: dict, comparison: str) -> str:
    """One line naming a row and its outcome: first divergence (or same suffix) and whether the comparison's cache is exact."""
    if row.get("gate_failure"):
        return f"{row['problem_id']} · gate failed ({row['gate_failure'].get('gate')})"
    ep = row.get("endpoints", {})
    fd = ep.get("first_divergence")
    suffix = f"diverges at token {fd}" if ep.get("suffix_differs") else "same suffix"
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
    """The interactive explorer: a row picker, an experiment/arm-pair picker, layer and head sliders and a K/V switch.

    ``Explorer(ledger_root, profile).widget`` is an ipywidgets box; display it in a notebook.
    Picking a row or pair rebuilds that pair's caches (cached per kernel, with a progress bar);
    sliders and the K/V switch redraw from the cache. ``last_draw_s`` holds the last redraw's
    wall time, also shown in the status line.

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
        self.kind = w.ToggleButtons(options=["key", "value"], description="K / V")
        self.progress = w.IntProgress(min=0, max=4, description="rebuild", layout=w.Layout(width="460px"))
        self.status = w.HTML()
        self.summary_out = w.Output()
        self.plot = w.Output()
        self._fill_rows(problem)
        self.pair_picker.observe(self._on_pair, names="value")
        self.row_picker.observe(self._on_row, names="value")
        for c in (self.layer, self.head, self.kind):
            c.observe(self._on_view, names="value")
        self.widget = w.VBox([
            w.HBox([self.pair_picker, self.kind]), self.row_picker, w.HBox([self.layer, self.head]),
            w.HBox([self.progress, self.status]), self.summary_out, self.plot,
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
        options = [(row_status(r, self.comparison), r["problem_id"]) for r in recs]
        ids = [v for _, v in options]
        first_div = next((r["problem_id"] for r in recs if r.get("endpoints", {}).get("suffix_differs")), ids[0] if ids else None)
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
        """Show the ledger's per-layer summary of the current row, rebuild its pair (cached), then draw."""
        from IPython.display import display

        row, comp = self.row, self.comparison
        ref, other = comparison_arms(self.ledger.key.split("-")[0], comp)
        summary = comparison_of(row, comp)
        with self.summary_out:
            self.summary_out.clear_output(wait=True)
            if "tensors" in summary:
                fig = figures.explorer_layers(layer_drift_frame(summary["tensors"]),
                                              title=f"{row['problem_id']}: {other} vs {ref}, {self.ledger.config['dtype']} (ledger)")
                display(_png(fig))
            else:
                print(f"the ledger keeps only the whole-cache summary for {comp} (exact: {summary['cache']['exact']})")
        pair = rebuild(self.ledger, row, comp, self.model, progress=self._tell)
        n_layers, n_heads = pair.maps[("key", "head")].shape
        self._quiet = True
        try:
            self.layer.max, self.head.max = n_layers - 1, n_heads - 1
        finally:
            self._quiet = False
        self.draw()

    def draw(self) -> None:
        """Redraw the heatmaps and the selected layer/head's per-position drift from the cached pair."""
        from IPython.display import display

        t0 = time.perf_counter()
        row, comp = self.row, self.comparison
        key = (str(self.ledger.dir), row["problem_id"], comp, self.model)
        pair = _PAIRS.get(key)
        if pair is None:
            return
        ref, other = comparison_arms(self.ledger.key.split("-")[0], comp)
        detail = head_position_drift(pair, self.layer.value, self.head.value, self.kind.value)
        fig = figures.explorer_view(pair.maps, detail, pair.tokens, pair.blocks, layer=self.layer.value, head=self.head.value,
                                    kind=self.kind.value, title=f"{row['problem_id']}: {other} vs {ref}, {self.ledger.config['dtype']}")
        image = _png(fig)
        with self.plot:
            self.plot.clear_output(wait=True)
            display(image)
        self.last_draw_s = time.perf_counter() - t0
        fp = all(pair.fingerprint.values())
        self.status.value = (f"<span class='kvreplay-status'>drawn in {self.last_draw_s:.2f} s · rebuilt in "
                             f"{pair.seconds['rebuild']:.1f} s (model load {pair.seconds['model']:.1f} s) · "
                             f"rebuilt drift equals the ledger's: {fp}</span>")

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
