"""Decoders: the live multi-branch generator and the one shared suffix decoder (paper §3.1–3.2).

Every forward call goes through :func:`forward`. It always passes an
explicit boolean 4-D mask ``[batch, 1, q, k]`` (causal AND role visibility;
no padding) and explicit position IDs counting tokens from 0. Its input is
embeddings, plus role-embedding rows when the model has a role table. A
sliding-window layer's mask also hides keys ``window`` or more positions
back (a dict of masks per layer type for a model mixing layer types,
:class:`~kvreplay.model.models.AttentionLayout`); every layer's cache keeps all
positions (:func:`~kvreplay.model.models.kv_cache`).

The physical batch is two duplicate copies of one problem. After every call
the two rows' logits must agree bit for bit; otherwise :class:`~kvreplay.gates.GateError`
(gate ``desync``) is raised and the row fails closed.

Call schedule: the live generator processes the prompt block in
one call, then exactly one token per call, forced delimiter tokens included.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections import deque
from collections.abc import Callable, Sequence

import torch
from torch.nn.attention import sdpa_kernel
from transformers import DynamicCache

from .contract import (
    ANSWER,
    BRANCH1,
    MERGE,
    PROMPT,
    ROLE_OFFSET,
    BlockFormat,
    Caps,
    ContractError,
    attention_mask_4d,
)
from ..model import kernels
from . import ties
from .settings import Decoding
from ..gates import GateError
from ..model.execution import sdpa_backend_list
from ..model.models import LoadedModel, context_length, kv_cache, layer_masks

BATCH = 2
"""Physical batch: two duplicate copies of one problem."""


@dataclasses.dataclass
class Boundary:
    """The decoder state at the merge boundary, for one construction.

    Attributes:
        construction: ``"live"``, ``"incremental"``, ``"prefill"``, or a
            replica / transplant label.
        ids: the boundary prefix z (flat token IDs of one copy, length |z|).
        roles: ``[2, |z|]`` int64 raw roles of both copies.
        cache: ``DynamicCache`` whose layers hold keys/values
            ``[2, kv_heads, |z|, head_dim]`` in the model dtype.
        logits: ``[2, vocab]`` next-token logits at the boundary (model dtype).
        schedule: tokens per forward call that built the cache.
        positions: ``[2, |z|]`` int64 position IDs actually passed to the
            model, concatenated over the calls (flat from 0; no padding).
        windows: per layer its sliding window in positions (``None``: full
            attention), or ``None`` when no layer slides
            (:attr:`kvreplay.model.models.AttentionLayout.windows`). Drift and the
            equivalence gate compare a sliding layer's last ``window - 1``
            positions, the ones a later query can attend to.
    """
    construction: str
    ids: list[int]
    roles: torch.Tensor
    cache: DynamicCache
    logits: torch.Tensor
    schedule: list[int]
    positions: torch.Tensor
    windows: tuple[int | None, ...] | None = None


def model_inputs(
    lm: LoadedModel, ids: torch.Tensor, roles_all: torch.Tensor, start: int, role_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inputs of one call: embeddings plus role rows, the explicit 4-D mask, position IDs.

    The one place they are built: the decoders (:func:`forward`) and the
    role-table training (:mod:`kvreplay.adapt`) both call it, so training sees
    exactly the roles, visibility and positions the decoders use.

    Args:
        lm: the loaded model.
        ids: ``[batch, q]`` int64 token IDs of this call.
        roles_all: ``[batch, start + q]`` int64 raw roles of all tokens so far.
        start: number of tokens before this call (= first position).
        role_table: ``[14, hidden]`` role rows to add instead of ``lm.role_table``
            (training passes its trainable table); ``None`` uses ``lm.role_table``.

    Returns:
        ``(embeds [batch, q, hidden], mask, positions [batch, q] int64)``; ``mask`` is
        ``[batch, 1, q, start + q]`` bool, or for a model mixing sliding-window and
        full layers a dict of such masks keyed by layer type (:func:`kvreplay.model.models.layer_masks`).
    """
    q = ids.shape[1]
    query_roles = roles_all[:, start:]
    embeds = lm.model.get_input_embeddings()(ids)
    table = lm.role_table if role_table is None else role_table
    if table is not None:
        embeds = embeds + table[query_roles + ROLE_OFFSET]
    mask = attention_mask_4d(query_roles, roles_all, start)
    layout = lm.layout
    if layout.windowed:
        k = roles_all.shape[1]
        index = torch.arange(k, device=ids.device)
        mask = layer_masks(layout, mask, index[start:], index)
    positions = torch.arange(start, start + q, device=ids.device).expand(ids.shape[0], q)
    return embeds, mask, positions


def forward(
    lm: LoadedModel, cache: DynamicCache, ids: torch.Tensor, roles_all: torch.Tensor, start: int,
    trace: list | None = None, *, check: bool = True, readout: "FP32Readout | None" = None,
) -> torch.Tensor:
    """One forward call over ``q`` new tokens of the duplicate batch.

    Args:
        lm: the loaded model.
        cache: cache holding the first ``start`` tokens; updated in place.
        ids: ``[2, q]`` int64 token IDs of this call.
        roles_all: ``[2, start + q]`` int64 raw roles of all tokens so far.
        start: number of tokens already in the cache (= first position).
        trace: if given, the ``[2, q]`` position IDs of this call are appended to it.
        check: check the logits now (a host sync): finite, and the duplicate
            rows equal. The greedy loop passes ``False`` and reads both checks
            together with the chosen token, so a decode step costs one sync.
        readout: when given, the final norm and LM head run in float32 on the
            model-dtype hidden state (:class:`FP32Readout`, an exploratory
            control); the KV cache is written exactly as without it.

    Returns:
        ``[2, vocab]`` logits of the last token of the call: model dtype, or
        float32 with ``readout``.

    Raises:
        GateError: gate ``nonfinite`` if a logit is NaN or infinite (checked
            first: NaN rows never compare equal), then ``desync`` if the two
            duplicate rows' logits differ.
        ContractError: the call reaches a position the model does not have
            (``max_position_embeddings``), before the model runs.
        kvreplay.model.kernels.UncoveredOperationError: an operation the contract does not cover ran under ``kernels:
            invariant`` (the FP32 readout's copies of the norm and head are covered: :func:`kvreplay.model.kernels.readout`).
            The kernels (``lm.contract.kernels``) are installed here around the model call
            (:func:`kvreplay.model.kernels.installed`).
    """
    q = ids.shape[1]
    limit = _positions(lm.model)
    if limit is not None and start + q > limit:
        raise ContractError(f"a forward call over positions {start}..{start + q - 1}, but the model has only {limit} "
                            f"(max_position_embeddings): a sequence this long is outside the model's context")
    embeds, mask, positions = model_inputs(lm, ids, roles_all, start)
    if trace is not None:
        trace.append(positions)
    kwargs = dict(inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
    with sdpa_kernel(_backends(lm.sdpa_backends)), kernels.installed(lm.model, kernels_of(lm)):
        if readout is None:
            logits = lm.model(**kwargs, logits_to_keep=1).logits[:, -1, :]
        else:
            logits = readout(lm, kwargs)
    lm.calls += 1
    if check:
        if not bool(torch.isfinite(logits).all()):
            raise _nonfinite(start + q - 1)
        if not torch.equal(logits[0], logits[1]):
            raise _desync(start + q - 1)
    return logits


def kernels_of(lm: LoadedModel) -> str:
    """The ``kernels`` value a model runs under: its contract's (:mod:`kvreplay.model.kernels`), ``default`` without one."""
    return lm.contract.kernels if lm.contract is not None else kernels.DEFAULT


class FP32Readout:
    """Final norm and LM head in float32 on the model-dtype hidden state (an exploratory control).

    The transformer body runs as usual in the model's dtype and writes the
    same KV cache. Only the last step -- the final RMS norm and the LM head,
    which turn the ``[2, hidden]`` hidden state into ``[2, vocab]`` logits --
    runs on float32 copies of their weights. Decoding the same BF16 boundary
    caches with it separates cache drift from BF16 logit granularity: BF16
    logits near the top are spaced 0.125 apart, so exact ties are common.

    Supports models whose final norm is ``model.model.norm`` (Llama, Qwen2,
    Mistral families) and whose LM head is the output embedding.
    Under a ``kernels`` value other than ``default`` the copies run as covered
    operations, row by row where their class is invariant (:func:`kvreplay.model.kernels.readout`).

    Raises:
        ContractError: if the model has no ``model.model.norm``.
    """
    def __init__(self, lm: LoadedModel):
        import copy

        base = getattr(lm.model, "model", None)
        if base is None or not hasattr(base, "norm"):
            raise ContractError(f"{type(lm.model).__name__}: no final norm at model.model.norm; FP32 readout unsupported")
        self.norm = copy.deepcopy(base.norm).float()
        self.head = copy.deepcopy(lm.model.get_output_embeddings()).float()

    def __call__(self, lm: LoadedModel, kwargs: dict) -> torch.Tensor:
        base = lm.model.model
        norm = base.norm
        base.norm = torch.nn.Identity()  # the body returns the pre-norm hidden state
        try:
            hidden = base(**kwargs).last_hidden_state[:, -1, :]
        finally:
            base.norm = norm
        return kernels.readout(kernels_of(lm), self.norm, self.head, hidden.float())


def rows_in_sync(logits: torch.Tensor) -> torch.Tensor:
    """0-d bool tensor on the logits' device: the two duplicate rows ``[2, vocab]`` are equal (as ``torch.equal``)."""
    return (logits[0] == logits[1]).all()


def _desync(position: int) -> GateError:
    return GateError("desync", f"duplicate rows' logits differ after the call ending at position {position}")


def _nonfinite(position: int) -> GateError:
    return GateError("nonfinite", f"NaN or infinite logits after the call ending at position {position}")


_POSITIONS: "weakref.WeakKeyDictionary[torch.nn.Module, int | None]" = weakref.WeakKeyDictionary()


def _positions(model: torch.nn.Module) -> int | None:
    """The model's ``max_position_embeddings`` (``None`` if it has none), read once per model object."""
    if model not in _POSITIONS:
        _POSITIONS[model] = context_length(model.config)
    return _POSITIONS[model]


@functools.cache
def _backends(names: tuple[str, ...]) -> list:
    return sdpa_backend_list(names)


def _as_batch(ids: Sequence[int], device) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=device).unsqueeze(0).expand(BATCH, -1).contiguous()


class BlockCursor:
    """Structural logits mask and block state machine (paper §3.1).

    Inside an open block the eligible tokens are non-special vocabulary and
    the block's closing token; a closing delimiter is forced at the cap;
    between blocks the next opening delimiter is forced token by token.
    ``tie_rule``, parsed (:attr:`kvreplay.decoding.settings.Decoding.tie_rule`), picks among exactly tied eligible tokens
    (:mod:`kvreplay.decoding.ties`; default ``lowest``).

    Raises:
        TypeError: a tie rule given by name (:func:`kvreplay.decoding.ties.check_parsed`).
    """
    def __init__(self, fmt: BlockFormat, caps: Caps, role: int, forced: Sequence[tuple[int, int]] = (),
                 tie_rule: ties.TieRule = ties.LOWEST):
        self.fmt, self.caps = fmt, caps
        self.tie_rule = ties.check_parsed(tie_rule, "BlockCursor tie_rule")
        self.last_top: float | None = None  # the top-1 eligible logit of the last model-chosen step (float32)
        self.role = role
        self.count = 0
        self.forced: deque[tuple[int, int]] = deque(forced)
        self.done = False
        self._answer_closing = False
        self._masks: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def in_content(self) -> bool:
        """True when the next token is chosen by the model (an open block)."""
        return not self.forced and not self.done

    def _close(self) -> None:
        closer = self.fmt.closers[self.role]
        queue = [(t, self.role) for t in closer]
        self._answer_closing = self.role == ANSWER
        if self.role < ANSWER:
            queue += [(t, self.role + 1) for t in self.fmt.openers[self.role + 1]]
        self.forced.extend(queue)

    def step(self, logits: torch.Tensor, in_sync: torch.Tensor | None = None,
             position: int | None = None) -> tuple[int, int, float | None, bool]:
        """Choose the next token from one row's logits ``[vocab]`` (greedy, Hugging Face semantics by default).

        The token is the argmax over the eligible logits; an exact tie goes by
        the cursor's tie rule (:func:`kvreplay.decoding.ties.choose`; ``lowest``: the
        first maximal index, as ``torch.argmax`` and ``generate(do_sample=False)``).
        The margin is the top-1 minus top-2 eligible logit, so an exact tie has
        margin 0; the top-1 logit is kept in :attr:`last_top`.

        Args:
            in_sync: optional 0-d bool tensor (the duplicate-row check of the
                call that produced ``logits``), read in the same host transfer
                as the chosen token and the finiteness check.
            position: the position ID the chosen token takes (the ``hash`` rule needs it).

        Returns:
            ``(token, role, margin, in_sync)``: the token and the raw role it
            belongs to; the top-1 minus top-2 eligible logit margin (float32
            logit units), or None for a forced token; and the value of
            ``in_sync`` (True when none was given).

        Raises:
            GateError: gate ``nonfinite`` if ``logits`` hold NaN or infinity.
        """
        if self.in_content and self.count >= self.caps.for_role(self.role):
            self._close()
        flag = torch.ones((), device=logits.device) if in_sync is None else in_sync.float()
        finite = torch.isfinite(logits).all().float()
        if self.forced:
            ok, fin = torch.stack([flag, finite]).tolist()
            if fin != 1.0:
                raise GateError("nonfinite", "NaN or infinite logits at a forced step")
            return (*self.take(-1, 0.0), ok == 1.0)
        key = (self.role, logits.shape[-1])
        if key not in self._masks:
            if logits.shape[-1] > 1 << 24:
                raise ContractError(f"vocabulary of {logits.shape[-1]} tokens: token IDs would not be exact in float32")
            self._masks[key] = self.fmt.content_mask(self.role, logits.device, logits.shape[-1])
        masked = logits.float().masked_fill(~self._masks[key], float("-inf"))
        top = torch.topk(masked, 2).values
        if self.tie_rule.kind == "lowest":
            choice = masked.argmax()
        else:
            where = None if position is None else torch.tensor([position], device=logits.device)
            choice = ties.choose(masked[None], self.tie_rule, where)[0]
        # one host transfer per step: token (exact in float32 below 2**24), float32 margin and top-1, sync and finiteness
        t, margin, top1, ok, fin = torch.stack([choice.float(), top[0] - top[1], top[0], flag, finite]).tolist()
        if fin != 1.0:
            raise GateError("nonfinite", "NaN or infinite logits at a model-chosen step")
        self.last_top = top1
        return (*self.take(int(t), margin), ok == 1.0)

    def take(self, chosen: int, margin: float) -> tuple[int, int, float | None]:
        """Advance the block state machine by one token: the next forced token if any, else ``chosen``.

        The one transition every decoder uses (:meth:`step` here, the batched
        engine with a token chosen on the device). Call it after the content cap
        was applied (as :meth:`step` does first).

        Returns:
            ``(token, raw role it belongs to, margin or None for a forced token)``.
        """
        if self.forced:
            token, role = self.forced.popleft()
            if not self.forced:
                if self._answer_closing:
                    self.done = True
                else:
                    self.role, self.count = role, 0
            return token, role, None
        role = self.role
        if chosen == self.fmt.closers[self.role][0]:
            self._close()
            self.forced.popleft()
            if not self.forced:  # one-token closer of the answer block
                self.done = self.role == ANSWER
        else:
            self.count += 1
        return chosen, role, margin


def _run(
    lm: LoadedModel,
    cursor: BlockCursor,
    cache: DynamicCache,
    ids: list[int],
    roles: torch.Tensor,
    logits: torch.Tensor,
    stop: Callable[[BlockCursor], bool],
    margins: list | None = None,
    trace: list | None = None,
    readout: FP32Readout | None = None,
    tops: list | None = None,
) -> tuple[list[int], torch.Tensor, torch.Tensor, int]:
    """Greedy loop: choose, then feed one token per call, until ``stop``.

    The duplicate-row check of each call is read with the next choice (one
    host sync per step); a desync raises before its logits are used. ``tops``
    gets each step's top-1 eligible logit (``None`` for a forced token).
    """
    new: list[int] = []
    calls = 0
    dev = logits.device
    pending: torch.Tensor | None = None  # duplicate check of the last call, not read yet
    last = len(ids) - 1
    while not stop(cursor):
        token, role, margin, ok = cursor.step(logits[0], pending, len(ids) + len(new))
        if not ok:
            raise _desync(last)
        pending = None
        new.append(token)
        if margins is not None:
            margins.append(margin)
        if tops is not None:
            tops.append(None if margin is None else cursor.last_top)
        roles = torch.cat([roles, torch.full((BATCH, 1), role, dtype=torch.long, device=dev)], dim=1)
        if cursor.done:
            break
        start = len(ids) + len(new) - 1
        logits = forward(lm, cache, torch.full((BATCH, 1), token, dtype=torch.long, device=dev), roles, start, trace,
                         check=False, readout=readout)
        pending, last = rows_in_sync(logits), start
        calls += 1
    if pending is not None and not bool(pending):
        raise _desync(last)
    return new, roles, logits, calls


@torch.inference_mode()
def decode_live(lm: LoadedModel, fmt: BlockFormat, prompt: Sequence[int], decoding: "Decoding | Caps") -> Boundary:
    """Ordinary greedy multi-branch decoding up to the merge boundary (live construction).

    Args:
        prompt: token IDs of the prompt block (role 0).
        decoding: the run's :class:`~kvreplay.decoding.settings.Decoding` (caps and the parsed tie rule), or content caps
            alone (the ``lowest`` rule); branches stop at ``caps.branch``.

    Returns:
        The live :class:`Boundary`: cache after the merge opener, with the
        logits that choose the first merge content token.

    Raises:
        GateError: ``desync`` if the duplicates diverge.
    """
    d = Decoding.given(decoding)
    dev = lm.device
    ids = list(prompt)
    roles = torch.full((BATCH, len(ids)), PROMPT, dtype=torch.long, device=dev)
    cache = new_cache(lm)
    trace: list = []
    logits = forward(lm, cache, _as_batch(ids, dev), roles, 0, trace)
    cursor = BlockCursor(fmt, d.caps, PROMPT, [(t, BRANCH1) for t in fmt.openers[BRANCH1]], d.tie_rule)
    new, roles, logits, calls = _run(
        lm, cursor, cache, ids, roles, logits, stop=lambda c: c.role == MERGE and c.in_content, trace=trace
    )
    return Boundary("live", ids + new, roles, cache, logits, [len(ids)] + [1] * calls, torch.cat(trace, dim=1),
                    lm.layout.windows)


def _fixed_prefix(lm: LoadedModel, fmt: BlockFormat, prefix: Sequence[int], where: str):
    """IDs, ``[2, |z|]`` roles and token batch rebuilt from a boundary prefix, an empty cache, and the prompt length."""
    parsed = fmt.boundary_parse(prefix, where=where)
    roles = torch.tensor(parsed.roles, dtype=torch.long, device=lm.device).expand(BATCH, -1).contiguous()
    ids = list(prefix)
    return ids, roles, _as_batch(ids, lm.device), new_cache(lm), parsed.prompt_len


def new_cache(lm: LoadedModel) -> DynamicCache:
    """An empty cache for the decoders: every layer keeps all positions (:func:`kvreplay.model.models.kv_cache`)."""
    return kv_cache(lm.model.config)


@torch.inference_mode()
def build_incremental(
    lm: LoadedModel, fmt: BlockFormat, prefix: Sequence[int], *, where: str = "prefix", readout: FP32Readout | None = None,
) -> Boundary:
    """Teacher-forced replay of the live call schedule (incremental construction).

    The prompt block is processed in one call, then every later token of z
    in its own call, exactly as :func:`decode_live` did. With ``readout`` the
    boundary logits come from :class:`FP32Readout` (the cache is the same).

    Raises:
        ContractError: if the prefix does not end at the boundary.
        GateError: ``desync``.
    """
    ids, roles, batch, cache, p = _fixed_prefix(lm, fmt, prefix, where)
    trace: list = []
    logits = forward(lm, cache, batch[:, :p], roles[:, :p], 0, trace, readout=readout)
    for i in range(p, len(ids)):
        logits = forward(lm, cache, batch[:, i : i + 1], roles[:, : i + 1], i, trace, readout=readout)
    return Boundary("incremental", ids, roles, cache, logits, [p] + [1] * (len(ids) - p), torch.cat(trace, dim=1),
                    lm.layout.windows)


@torch.inference_mode()
def build_prefill(
    lm: LoadedModel, fmt: BlockFormat, prefix: Sequence[int], *, where: str = "prefix", readout: FP32Readout | None = None,
) -> Boundary:
    """One forward call over the whole prefix z (prefill construction); ``readout`` as in :func:`build_incremental`.

    Raises:
        ContractError: if the prefix does not end at the boundary.
        GateError: ``desync``.
    """
    ids, roles, batch, cache, _ = _fixed_prefix(lm, fmt, prefix, where)
    trace: list = []
    logits = forward(lm, cache, batch, roles, 0, trace, readout=readout)
    return Boundary("prefill", ids, roles, cache, logits, [len(ids)], torch.cat(trace, dim=1), lm.layout.windows)


@dataclasses.dataclass
class Suffix:
    """A decoded continuation from a boundary through the closed answer block.

    Attributes:
        tokens: every token after the boundary (merge content, merge closer,
            answer opener, answer content, answer closer).
        margins: per suffix step, top-1 minus top-2 eligible logit margin
            when the model chose the token, ``None`` for forced tokens.
        merge: merge content token IDs. answer: answer content token IDs.
        tops: per suffix step, the top-1 eligible logit (float32) when the
            model chose the token, ``None`` for forced tokens.
    """
    tokens: list[int]
    margins: list[float | None]
    merge: list[int]
    answer: list[int]
    tops: list[float | None] = dataclasses.field(default_factory=list)


@torch.inference_mode()
def decode_suffix(
    lm: LoadedModel, fmt: BlockFormat, boundary: Boundary, decoding: "Decoding | Caps", *,
    readout: FP32Readout | None = None,
) -> Suffix:
    """The shared suffix decoder: continue any boundary state through merge and answer.

    Every arm (live, replica, prefill, incremental, transplant) goes through
    this one function with the same caps, schedule (one token per call),
    masks, positions and duplicate batch. The boundary's cache is extended
    in place (it is consumed); take replicas and summaries first. With
    ``readout`` every step's logits come from :class:`FP32Readout` (the
    exploratory FP32-readout control; the boundary's logits should come from
    a construction built with the same readout). ``decoding`` as in :func:`decode_live`.

    Raises:
        GateError: ``nonfinite``, ``desync``.
    """
    d = Decoding.given(decoding)
    cursor = BlockCursor(fmt, d.caps, MERGE, tie_rule=d.tie_rule)
    margins: list = []
    tops: list = []
    new, _, _, _ = _run(
        lm, cursor, boundary.cache, boundary.ids, boundary.roles, boundary.logits, stop=lambda c: c.done, margins=margins,
        readout=readout, tops=tops,
    )
    parsed = fmt.parse(boundary.ids + new, where=f"{boundary.construction} suffix")
    if not parsed.complete:
        raise ContractError(f"{boundary.construction} suffix: the answer block was not closed")
    full = boundary.ids + new
    (m0, m1), (a0, a1) = parsed.content[MERGE], parsed.content[ANSWER]
    return Suffix(new, margins, full[m0:m1], full[a0:a1], tops)


def first_eligible_argmax(fmt: BlockFormat, logits: torch.Tensor, tie_rule: ties.TieRule = ties.LOWEST,
                          position: int | None = None) -> int:
    """Greedy choice from boundary logits ``[vocab]`` over tokens eligible in the open merge block.

    An exact tie goes by ``tie_rule``, parsed (default: the lowest ID); ``position``, the boundary's length, for ``hash``.
    """
    mask = fmt.content_mask(MERGE, logits.device, logits.shape[-1])
    masked = logits.float().masked_fill(~mask, float("-inf"))
    where = None if position is None else torch.tensor([position], device=logits.device)
    return int(ties.choose(masked[None], tie_rule, where)[0])


def raw_argmax(logits: torch.Tensor) -> int:
    """Unmasked argmax of boundary logits ``[vocab]`` (the paper's raw next-token argmax; lowest ID on a tie)."""
    return int(logits.float().argmax())
