"""The batched one-token step: static input buffers, the model call, greedy choice and gates on the device.

:class:`StepEngine` runs ``2B`` rows (``B`` problems, two duplicate rows each) through one forward call per
step, eagerly or replayed from a CUDA graph. On request it checks a graph step against the eager one
(gate ``graph_equals_eager``). It checks each slot's valid length (gate ``functional_state``) and, for an
attention of its own, every layer's attention output against the math-SDPA reference (gate ``attention_tolerance``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch
from torch.nn.attention import sdpa_kernel
from transformers import AttentionInterface, DynamicCache

from ..decoding import decode, ties
from ..decoding.contract import ANSWER, BRANCH1, MERGE, PROMPT, ROLE_OFFSET, BlockFormat, ContractError, visibility_matrix
from ..decoding.settings import Decoding
from ..gates import GateError
from ..model.models import LoadedModel, layer_masks
from . import attention as attn
from . import cache as row_cache
from . import invariant
from .attention import ATTENTIONS, FLEX_BLOCK, FlexMask, use_attention
from .cache import RowCache
from .run import EngineRun, EngineStats

STEP_PATHS = ("eager", "graph")
"""``eager``: the step runs op by op; ``graph``: captured once in a CUDA graph and replayed (CUDA only)."""

_STAT_ROWS = 4  # chosen token, margin, duplicate rows equal, row finite



def choice_stats(logits: torch.Tensor, eligible: torch.Tensor, tie_rule: ties.TieRule = ties.LOWEST,
                 position: torch.Tensor | None = None, *, top: bool = False) -> torch.Tensor:
    """Greedy choice, margin and integrity flags of every row, computed on the device.

    Args:
        logits: ``[rows, vocab]`` next-token logits (model dtype), rows in duplicate pairs ``(2s, 2s + 1)``.
        eligible: ``[rows, vocab]`` bool structural mask (true = may be chosen).
        tie_rule: which of exactly tied eligible tokens is chosen (:func:`kvreplay.decoding.ties.choose`, the eager
            decoders' function); ``position``: ``[rows]`` int64 position IDs of the tokens chosen (``hash`` only).
        top: add row 4, the top-1 eligible logit.

    Returns:
        ``[4, rows]`` float32 (``[5, rows]`` with ``top``). Row 0 is the chosen token (argmax of the eligible
        logits in float32, an exact tie broken by ``tie_rule``; exact for vocabularies
        below 2**24). Row 1 is the margin top-1 minus top-2 eligible logit (float32
        logit units). Row 2 is 1.0 where the row's duplicate pair is bit-identical
        (as ``torch.equal``: NaN never is). Row 3 is 1.0 where every logit of the row is finite.
    """
    rows, vocab = logits.shape
    masked = logits.float().masked_fill(~eligible, float("-inf"))
    idx = ties.choose(masked, tie_rule, position)
    top1 = masked.gather(1, idx[:, None]).squeeze(1)
    with row_cache._unique_index_writes():  # one index per row
        top2 = masked.scatter(1, idx[:, None], float("-inf")).amax(-1)
    pair = logits.reshape(rows // 2, 2, vocab)
    same = (pair[:, 0] == pair[:, 1]).all(-1)
    same = same[:, None].expand(rows // 2, 2).reshape(rows)
    finite = torch.isfinite(logits).all(-1)
    return torch.stack([idx.float(), top1 - top2, same.float(), finite.float(), *([top1] if top else [])])


class StepEngine:
    """Static buffers and the batched one-token step of ``rows = 2 * batch`` rows.

    Per row the step reads, from device buffers updated in place: the input
    token, its position, its raw role (query role), and the raw role of the
    block the *next* token is chosen in (its structural mask). The raw roles
    of every earlier position of the row live in :attr:`roles`. It writes the
    new token's role and keys/values at the row's position, builds the row's
    mask (role visibility AND ``k <= position``), runs the model, and leaves
    ``[rows, vocab]`` logits and :func:`choice_stats` in output buffers.

    A model with sliding-window layers (``lm.layout``, docs/models.md) gets its masks as the eager decoders
    give them: the sliding layers' mask also hides keys ``window`` or more positions back
    (:func:`kvreplay.model.models.layer_masks`), one mask per layer type when the model mixes them
    (``{"full_attention", "sliding_attention"}``), one windowed mask when every layer slides. The static cache
    keeps every position of every layer.

    Args:
        lm: the loaded model (its ``sdpa_backends`` are used in every step).
        fmt: block format (structural masks per role).
        run: the engine's settings (:class:`~kvreplay.engine.run.EngineRun`); the engine reads these:

            - ``batch``: problems per step ``B`` (``2B`` rows).
            - ``max_len``: positions per row (the cache's key dimension); ``None``: what ``need`` positions take
              (:meth:`~kvreplay.engine.run.EngineRun.max_len_for`).
            - ``step_path``: ``"eager"`` or ``"graph"`` (CUDA only; captured at the first step).
            - ``verify_steps``: the first ``verify_steps`` steps are each computed a second time by the eager step
              on the same inputs. Logits, choice statistics and keys/values written must agree bit for bit (gate
              ``graph_equals_eager``). The step is idempotent for fixed inputs, so a passing check changes no bit.
            - ``attention``: ``"sdpa"``, ``"grouped"`` or ``"flex"`` (:data:`ATTENTIONS`), the step's attention.
              Prompt blocks and prefills, one call per problem outside the step, always use the model's own SDPA.
              ``"flex"`` needs ``max_len`` a multiple of :data:`~kvreplay.engine.attention.FLEX_BLOCK`; it builds
              a :class:`~kvreplay.engine.attention.FlexMask` per layer type (the sliding one with the window).
        need: the positions the longest sequence may take (checked against a fixed ``run.max_len``).
        decoding: what each row chooses by (:class:`~kvreplay.decoding.settings.Decoding`, as the eager decoders). Its parsed
            tie rule picks among exactly tied eligible tokens (``hash`` hashes the chosen token's position, the
            input position plus one). With ``top_logits`` the choice statistics carry each row's top-1 eligible
            logit (row 4). Its caps are the scheduler's. ``None``: the ``lowest`` rule, no top logits.
        readout: a :class:`kvreplay.decoding.decode.FP32Readout`: the body runs in the model
            dtype and writes the same keys/values, the final norm and LM head run in
            float32 (``[rows, vocab]`` float32 logits; the exploratory control of
            Experiment 2). ``None``: the model's own head.

    Attributes:
        stats: what this engine measured (:class:`~kvreplay.engine.run.EngineStats`: steps, slot-steps, busy
            slot-steps, verified steps, attention checks, key positions read, graph capture time). The batched
            decoders return it with their results.

    Raises:
        ValueError: unknown step path or attention, ``graph`` off CUDA, ``batch < 1``, ``max_len < 1``,
            ``verify_steps < 0``, a fixed ``max_len`` below ``need``, or ``"flex"`` with a ``max_len`` that is not
            a multiple of 128.
        ContractError: a vocabulary of 2**24 tokens or more; under ``kernels`` other than ``default``, the ``graph``
            step path, an attention other than ``sdpa`` or a readout (:func:`kvreplay.engine.invariant.check_engine`;
            the eager step then runs the invariant kernels, :mod:`kvreplay.engine.invariant`).
    """
    def __init__(self, lm: LoadedModel, fmt: BlockFormat, run: EngineRun, *, need: int = 0,
                 decoding: Decoding | None = None, readout: decode.FP32Readout | None = None):
        self.stats = EngineStats()
        batch, max_len, step_path, attention = run.batch, run.max_len_for(need), run.step_path, run.attention
        if step_path not in STEP_PATHS:
            raise ValueError(f"unknown step path {step_path!r}; use one of {STEP_PATHS}")
        invariant.check_engine(lm, step_path, attention, readout)  # ContractError: a setting `kernels` does not cover
        if attention not in ATTENTIONS:
            raise ValueError(f"unknown attention {attention!r}; use one of {ATTENTIONS}")
        self.attention = attention
        if decoding is not None and not isinstance(decoding, Decoding):
            raise TypeError(f"StepEngine: decoding must be a Decoding (Decoding.of(caps, ...)) or None, got {decoding!r}")
        self.decoding = decoding
        self.tie_rule = decoding.tie_rule if decoding is not None else ties.LOWEST
        self.top_logits = decoding.top_logits if decoding is not None else False
        if step_path == "graph" and lm.device.type != "cuda":
            raise ValueError(f"step path 'graph' needs a CUDA device, the model is on {lm.device}")
        if batch < 1 or max_len < 1:
            raise ValueError(f"batch and max_len must be at least 1, got {batch} and {max_len}")
        if run.verify_steps < 0:
            raise ValueError(f"verify_steps must be at least 0, got {run.verify_steps}")
        self.verify_steps = run.verify_steps
        self.readout = readout
        self.lm, self.fmt, self.batch, self.max_len, self.step_path = lm, fmt, batch, max_len, step_path
        self.rows = rows = 2 * batch
        dev = lm.device
        vocab = lm.model.get_output_embeddings().weight.shape[0]
        if vocab > 1 << 24:
            raise ContractError(f"vocabulary of {vocab} tokens: token IDs would not be exact in float32")
        # inputs: token, position, query role, choice role  ([4, rows] int64, one host-to-device copy per step)
        self.inputs = torch.zeros(4, rows, dtype=torch.long, device=dev)
        self._host = torch.zeros(4, rows, dtype=torch.long, pin_memory=dev.type == "cuda")
        self._staged = self._host.numpy()  # the same memory, written once per step from the per-slot lists below
        self._next: list[list[int]] = [[0] * batch, [0] * batch, [PROMPT] * batch, [MERGE] * batch]
        self._busy = [False] * batch
        self.cache = RowCache.for_model(lm, rows, max_len, write_pos=self.inputs[1])
        self.roles = torch.zeros(rows, max_len, dtype=torch.long, device=dev)
        self._vis = visibility_matrix(dev)
        self.layout = lm.layout
        self._flex: dict[str, FlexMask] | None = None  # per layer type present: "full_attention", "sliding_attention"
        if attention == "flex":
            cfg = lm.model.config
            group = cfg.num_attention_heads // (getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)
            self._flex = {kind: FlexMask(self.inputs[1], self.inputs[2], self.roles, self._vis, group,
                                         self.layout.window if kind == "sliding_attention" else None)
                          for kind in sorted(set(self.layout.layer_types))}
        eligible = torch.ones(6, vocab, dtype=torch.bool, device=dev)
        for role in range(BRANCH1, ANSWER + 1):
            eligible[role] = fmt.content_mask(role, dev, vocab)
        self._eligible = eligible
        self._k = torch.arange(max_len, device=dev)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._out: tuple[torch.Tensor, torch.Tensor] | None = None
        self.idle_all()

    # ---- buffers
    def idle_all(self) -> None:
        """Put every row in the idle state (token 0 at position 0 with role prompt: attends to key 0 only)."""
        self._next = [[0] * self.batch, [0] * self.batch, [PROMPT] * self.batch, [MERGE] * self.batch]
        self._busy = [False] * self.batch

    def admit(self, slot: int, cache: DynamicCache, roles: torch.Tensor) -> int:
        """Load a duplicate pair's state into slot ``slot`` (rows ``2*slot``, ``2*slot + 1``), clearing them first.

        Args:
            cache: layers ``[2, kv_heads, n, head_dim]`` in the model dtype.
            roles: ``[2, n]`` int64 raw roles of the ``n`` positions.

        Returns:
            ``n``.

        Raises:
            ValueError: wrong geometry, dtype, or ``n >= max_len`` (no room for one more token).
        """
        r = 2 * slot
        n = self.cache.load_rows(r, cache)
        if tuple(roles.shape) != (2, n):
            raise ValueError(f"roles must be [2, {n}], got {tuple(roles.shape)}")
        if n >= self.max_len:
            raise ValueError(f"a prefix of {n} positions leaves no room in max_len={self.max_len}")
        self.roles[r : r + 2].zero_()
        self.roles[r : r + 2, :n].copy_(roles)
        return n

    def set_row_pair(self, slot: int, token: int, position: int, role: int, choice_role: int) -> None:
        """Stage the next step's inputs of one problem (both duplicate rows; host side, copied at :meth:`step`).

        Raises:
            ContractError: ``position >= max_len``.
        """
        if position >= self.max_len:
            raise ContractError(f"slot {slot}: position {position} is beyond max_len={self.max_len}")
        n = self._next
        n[0][slot], n[1][slot], n[2][slot], n[3][slot] = token, position, role, choice_role
        self._busy[slot] = True

    def _stage(self) -> None:
        """Write the staged inputs of every slot into the pinned host buffer (both duplicate rows of each)."""
        self._staged[:] = np.repeat(np.asarray(self._next, dtype=np.int64), 2, axis=1)

    def set_idle(self, slot: int) -> None:
        """Stage slot ``slot`` as idle for the next step (its outputs are ignored)."""
        self.set_row_pair(slot, 0, 0, PROMPT, MERGE)
        self._busy[slot] = False

    # ---- the step
    def _allowed(self) -> torch.Tensor:
        """``[rows, max_len]`` bool: role visibility AND causal, from the input and role buffers (``True``: attend)."""
        pos, qrole = self.inputs[1], self.inputs[2]
        return self._vis[qrole[:, None], self.roles] & (self._k[None, :] <= pos[:, None])

    def _dense_mask(self) -> "torch.Tensor | dict[str, torch.Tensor]":
        """The model's ``attention_mask`` for ``sdpa`` and ``grouped``: ``[rows, 1, 1, max_len]`` bool, or per layer
        type for a model mixing them (:func:`kvreplay.model.models.layer_masks`, each row's one query at its position)."""
        allowed = self._allowed()
        if not self.layout.windowed:
            return allowed[:, None, None, :]
        rows = self.rows
        # the rows' queries as the q axis of one [1, 1, rows, max_len] mask: layer_masks applies the window per row
        masks = layer_masks(self.layout, allowed.view(1, 1, rows, self.max_len), self.inputs[1], self._k)
        if isinstance(masks, dict):
            return {kind: m.view(rows, 1, 1, self.max_len) for kind, m in masks.items()}
        return masks.view(rows, 1, 1, self.max_len)

    def _flex_mask(self):
        """The model's ``attention_mask`` for ``flex``: each layer type's block mask, updated for this step."""
        assert self._flex is not None
        for fm in self._flex.values():
            fm.update()
        if not self.layout.windowed:
            return self._flex["full_attention"].block_mask
        if not self.layout.mask_by_type:
            return self._flex["sliding_attention"].block_mask
        return {kind: fm.block_mask for kind, fm in self._flex.items()}

    def _compute(self, attention: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        lm = self.lm
        token, pos, qrole, crole = self.inputs
        with row_cache._unique_index_writes():  # one position per row
            self.roles.scatter_(1, pos[:, None], qrole[:, None])
        if self._flex is not None and attention in (None, attn._CHECK):
            mask = self._flex_mask()  # the flex step reads the buffers itself: no dense mask
        else:
            mask = self._dense_mask()
        embeds = lm.model.get_input_embeddings()(token[:, None])
        if lm.role_table is not None:
            embeds = embeds + lm.role_table[qrole + ROLE_OFFSET][:, None, :]
        kwargs = dict(inputs_embeds=embeds, attention_mask=mask, position_ids=pos[:, None],
                      past_key_values=self.cache, use_cache=True)
        with (sdpa_kernel(decode._backends(lm.sdpa_backends)), use_attention(lm.model, attention or self.attention),
              invariant.step_kernels(lm)):
            if self.readout is None:
                logits = lm.model(**kwargs, logits_to_keep=1).logits[:, -1, :]
            else:
                logits = self.readout(lm, kwargs)
        position = pos + 1 if self.tie_rule.kind == "hash" else None  # the chosen token's position
        return logits, choice_stats(logits, self._eligible[crole], self.tie_rule, position, top=self.top_logits)

    def _capture(self) -> None:
        # The step is idempotent for fixed inputs (it rewrites the same role and keys/values at each row's
        # position before reading them), so the warm-up runs do not change what the first replay computes.
        side = torch.cuda.Stream(device=self.lm.device)
        side.wait_stream(torch.cuda.current_stream(self.lm.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self._compute()
        torch.cuda.current_stream(self.lm.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = self._compute()
        self._graph = graph

    def step(self) -> tuple[torch.Tensor, list[list[float]]]:
        """Copy the staged inputs to the device and run one batched step.

        Returns:
            ``(logits, stats)``: ``[rows, vocab]`` logits on the device (a static
            buffer on the graph path: valid until the next step) and
            :func:`choice_stats` read to the host as 4 lists of ``rows`` floats
            (the step's one host sync).
        """
        self._stage()
        self.inputs.copy_(self._host, non_blocking=True)
        busy = sum(self._busy)
        step = self.stats.steps  # this step's index
        self.stats.steps += 1
        self.stats.slot_steps += self.batch
        self.stats.busy_slot_steps += busy
        self.stats.kv_positions += sum(p + 1 for p, b in zip(self._next[1], self._busy) if b)
        if self.step_path == "graph":
            if self._graph is None:
                t0 = time.perf_counter()
                self._capture()
                self.stats.capture_s += time.perf_counter() - t0
            self._graph.replay()
            logits, stats = self._out
        else:
            logits, stats = self._compute()
        if step < self.verify_steps:
            self._verify(logits, stats, step)
        self.lm.calls += 1
        return logits, stats.tolist()

    def _written(self) -> list[torch.Tensor]:
        """Keys and values at every row's current write position: per layer ``[rows, kv_heads, 1, head_dim]``."""
        return [t.gather(2, layer._index) for layer in self.cache.layers for t in (layer.keys, layer.values)]

    def _verify(self, logits: torch.Tensor, stats: torch.Tensor, step: int) -> None:
        """Recompute step ``step`` eagerly on the same inputs; require identical logits, statistics and keys/values.

        Raises:
            GateError: gate ``graph_equals_eager``, naming the step and what differed.
        """
        first = (logits.clone(), stats.clone(), [t.clone() for t in self._written()])
        again = self._compute()
        second = (again[0], again[1], self._written())
        for name, a, b in zip(("logits", "choice statistics"), first[:2], second[:2]):
            if not torch.equal(a, b):
                raise GateError("graph_equals_eager", f"step {step} ({self.step_path} vs eager): {name} differ")
        if not all(torch.equal(a, b) for a, b in zip(first[2], second[2])):
            raise GateError("graph_equals_eager",
                            f"step {step} ({self.step_path} vs eager): keys/values written differ")
        self.stats.verified_steps += 1

    @torch.inference_mode()
    def check_attention(self, where: str = "") -> dict:
        """Gate ``attention_tolerance``: every layer's attention output of the staged step against the reference.

        Runs the staged step once more, eagerly; the step is idempotent for fixed inputs, so no bit of the run
        changes. Each layer's attention is computed twice on the same query, keys, values and mask: by the
        engine's attention (which feeds the next layer, as in a real step) and by
        :func:`~kvreplay.engine.attention.reference_attention` (torch's math SDPA in float64). The reference's
        mask is built here, apart from the engine's: role visibility AND causal, and for a sliding-window layer
        (``lm.layout``, by the layer's index) also ``position - k < window``. The relative
        error of layer ``l`` is ``||out_l - ref_l||_2 / ||ref_l||_2`` over the rows of the busy slots (every row
        if none is). Every layer's must stay within :data:`~kvreplay.engine.attention.TOLERANCE` (1e-2 in BF16,
        1e-5 in FP32).

        Args:
            where: named in the record and in a failure (e.g. the problem whose boundary is in a slot).

        Returns:
            The record (also appended to ``stats.attention_checks``):
            ``{"gate", "attention", "dtype", "reference", "tolerance", "max_rel_err", "rel_err_by_layer",
            "rows", "step", "where"}``.

        Raises:
            GateError: ``attention_tolerance``, naming the first layer beyond the tolerance.
            ValueError: the ``sdpa`` attention (it is the reference's own call: nothing to check).
        """
        if self.attention == "sdpa":
            raise ValueError("attention_tolerance checks an attention of the engine's own; 'sdpa' is the model's call")
        tolerance = attn.TOLERANCE[self.lm.dtype]
        self._stage()
        self.inputs.copy_(self._host)
        busy = np.flatnonzero(np.repeat(self._busy, 2))
        rows = torch.as_tensor(busy if busy.size else np.arange(self.rows), device=self.inputs.device)
        allowed = self._allowed()[rows]
        windows = self.layout.windows or (None,) * len(self.layout.layer_types)
        near = self.inputs[1][rows][:, None] - self._k[None, :]  # [rows, max_len]: how far back each key is
        tested = attn.attention_function(self.attention)
        errors: list[float] = []

        def both(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
            out, _ = tested(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
            window = windows[module.layer_idx]
            seen = allowed if window is None else allowed & (near < window)
            ref = attn.reference_attention(query[rows], key[rows], value[rows], seen[:, None, None, :], scaling)
            errors.append(float(torch.linalg.vector_norm(out[rows].double() - ref) / torch.linalg.vector_norm(ref)))
            return out, None

        AttentionInterface.register(attn._CHECK, both)
        try:
            self._compute(attention=attn._CHECK)
        finally:
            AttentionInterface.register(attn._CHECK, tested)
        worst = max(errors)
        record = {"gate": "attention_tolerance", "attention": self.attention, "dtype": str(self.lm.dtype).split(".")[-1],
                  "reference": "math SDPA, float64, same inputs", "tolerance": tolerance, "max_rel_err": worst,
                  "rel_err_by_layer": errors, "rows": int(rows.numel()), "step": self.stats.steps, "where": where}
        bad = [i for i, e in enumerate(errors) if not e <= tolerance]  # NaN fails too
        if bad:
            raise GateError("attention_tolerance",
                            f"{where}: attention {self.attention!r} at step {self.stats.steps}: layer {bad[0]}'s output "
                            f"differs from the math-SDPA reference by a relative L2 error of {errors[bad[0]]:.3g} > "
                            f"{tolerance:g} ({self.lm.dtype}); {len(bad)} of {len(errors)} layers beyond it")
        self.stats.attention_checks.append(record)
        return record

    def check_valid_length(self, slot: int, n: int, roles: Sequence[int], where: str) -> None:
        """Functional state of a slot's rows in the padded static cache: exactly ``n`` valid positions.

        Positions ``0..n-1`` must carry the problem's raw roles ``roles[:n]``.
        Every position from ``n`` to ``max_len - 1`` must be padding: role 0 and
        keys/values exactly zero in every layer (never written, so what the
        mask hides is nothing), in both duplicate rows.

        Args:
            slot: the problem's slot (rows ``2*slot``, ``2*slot + 1``).
            n: positions the problem has written (its valid length).
            roles: raw roles of at least ``n`` tokens.

        Raises:
            GateError: gate ``functional_state``.
        """
        r = 2 * slot
        want = torch.zeros(self.max_len, dtype=torch.long, device=self.roles.device)
        want[:n] = torch.tensor(list(roles[:n]), dtype=torch.long, device=want.device)
        bad = [(self.roles[r : r + 2] != want).any()]
        for layer in self.cache.layers:
            bad += [layer.keys[r : r + 2, :, n:].ne(0).any(), layer.values[r : r + 2, :, n:].ne(0).any()]
        flags = torch.stack(bad).tolist()
        if flags[0]:
            raise GateError("functional_state", f"{where}: the engine's role row differs from the problem's "
                            f"roles within its valid length {n} or is not padding beyond it")
        if any(flags[1:]):
            raise GateError("functional_state", f"{where}: keys/values written beyond the valid length {n} "
                            f"(positions the mask hides must be untouched padding)")

    def first_choice(self, logits: torch.Tensor, choice_role: int, position: int = 0) -> list[list[float]]:
        """:func:`choice_stats` of a duplicate pair's logits ``[2, vocab]`` (from a prefill), read to the host.

        ``position``: the position ID of the token chosen (the prefix's length), for the ``hash`` tie rule."""
        eligible = self._eligible[choice_role].expand(2, -1)
        where = torch.full((2,), position, dtype=torch.long, device=logits.device)
        return choice_stats(logits, eligible, self.tie_rule, where, top=self.top_logits).tolist()

