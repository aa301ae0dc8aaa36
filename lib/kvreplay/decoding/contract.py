"""The multi-branch block contract (paper §3.1, Table 2).

One problem becomes one flat token sequence of six ordered, non-nested blocks::

    prompt | branch 1 | branch 2 | branch 3 | merge | answer
    role 0 | role 1   | role 2   | role 3   | role 4| role 5

Opening and closing delimiters carry the role of their block. A delimiter is a
fixed *sequence* of token IDs that begins with a special token (a stock chat
model has no dedicated delimiter tokens, so an opener such as
``<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`` is forced one
token at a time). Block content never contains a special token: inside an open
block the structural logits mask admits non-special vocabulary plus the first
token of the block's closing delimiter, which the model emits to close it.

The format is data (a YAML file under ``kvreplay/formats``), resolved against a
tokenizer into a :class:`BlockFormat` of token-ID sequences. Sequences are
always built from IDs and never re-tokenized; roles, positions and visibility
are rebuilt from the IDs by one parser, :meth:`BlockFormat.parse`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from ..paths import FORMATS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

PROMPT, BRANCH1, BRANCH2, BRANCH3, MERGE, ANSWER = range(6)
ROLE_NAMES = ("prompt", "branch1", "branch2", "branch3", "merge", "answer")
ROLE_OFFSET = 8
"""Raw role r indexes role-embedding row r + 8 (rows 8..13 of a 14-row table)."""
N_ROLE_ROWS = 14

# Table 2: query role -> key roles it may attend to. Branches are parallel and
# blind to each other; the answer never sees branch tokens.
VISIBILITY: dict[int, frozenset[int]] = {
    PROMPT: frozenset({PROMPT}),
    BRANCH1: frozenset({PROMPT, BRANCH1}),
    BRANCH2: frozenset({PROMPT, BRANCH2}),
    BRANCH3: frozenset({PROMPT, BRANCH3}),
    MERGE: frozenset({PROMPT, BRANCH1, BRANCH2, BRANCH3, MERGE}),
    ANSWER: frozenset({PROMPT, MERGE, ANSWER}),
}


class ContractError(ValueError):
    """A token sequence, format or problem violates the block contract."""


def visibility_matrix(device: torch.device | str = "cpu") -> torch.Tensor:
    """Table 2 as a boolean matrix.

    Returns:
        ``[6, 6]`` bool tensor ``V`` with ``V[q, k]`` true iff a query of raw
        role ``q`` may attend to a key of raw role ``k`` (raw roles, before the
        +8 role-embedding offset).
    """
    return _visibility(str(torch.device(device))).clone()


@functools.cache
def _visibility(device: str) -> torch.Tensor:
    """Table 2 built once per device (read-only; :func:`attention_mask_4d` indexes it every call)."""
    v = torch.zeros(6, 6, dtype=torch.bool)
    for q, keys in VISIBILITY.items():
        for k in keys:
            v[q, k] = True
    return v.to(device)


def attention_mask_4d(query_roles: torch.Tensor, key_roles: torch.Tensor, query_start: int) -> torch.Tensor:
    """Explicit attention mask: causal AND role visibility (paper §3.1).

    There is no padding in the duplicate design, so key/query validity is all
    true; positions are the flat indices of the sequence.

    Args:
        query_roles: ``[batch, q]`` int64 raw roles of the tokens in this call.
        key_roles: ``[batch, k]`` int64 raw roles of every token seen so far,
            this call's tokens included (``k >= q``).
        query_start: flat position of the first query token (``k - q``).

    Returns:
        ``[batch, 1, q, k]`` bool mask, true where attention is allowed.
    """
    vis = _visibility(str(query_roles.device))
    allowed = vis[query_roles.unsqueeze(-1), key_roles.unsqueeze(-2)]  # [b, q, k]
    q = query_roles.shape[-1]
    k = key_roles.shape[-1]
    if q == 1 and k == query_start + 1:  # one new token sees every earlier position: causality adds nothing
        return allowed.unsqueeze(1)
    q_pos = torch.arange(query_start, query_start + q, device=query_roles.device)
    k_pos = torch.arange(k, device=query_roles.device)
    causal = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [q, k]
    return (allowed & causal).unsqueeze(1)


@dataclasses.dataclass(frozen=True)
class Caps:
    """Content-token caps per block (paper: 768 / 512 / 64)."""

    branch: int
    merge: int
    answer: int

    def for_role(self, role: int) -> int:
        if role in (BRANCH1, BRANCH2, BRANCH3):
            return self.branch
        if role == MERGE:
            return self.merge
        if role == ANSWER:
            return self.answer
        raise ContractError(f"role {role} ({ROLE_NAMES[role]}) has no content cap")


@dataclasses.dataclass(frozen=True)
class Parsed:
    """Roles and block spans rebuilt from token IDs by :meth:`BlockFormat.parse`.

    Attributes:
        roles: raw role (0..5) of every token, same length as the IDs.
        content: per role 1..5, the ``(start, end)`` flat span of its content
            tokens (end exclusive), or ``None`` if the block was not reached.
        boundary: flat length of the prefix through the merge opener (the
            paper's |z|), or ``None`` if the merge opener is incomplete.
        prompt_len: number of prompt-block tokens.
        complete: whether the answer block is closed.
    """
    roles: tuple[int, ...]
    content: dict[int, tuple[int, int] | None]
    boundary: int | None
    prompt_len: int
    complete: bool


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block format resolved to token IDs for one tokenizer.

    Attributes:
        name: the format's name (from its YAML).
        digest: sha256 of the resolved format (spec plus token IDs).
        openers: for roles 1..5, the opening delimiter token IDs (index 0 unused).
        closers: for roles 1..5, the closing delimiter token IDs; ``closers[r][0]``
            is the special token the model emits to close block r.
        special_ids: token IDs that never appear inside block content.
        vocab_size: number of real tokenizer entries (IDs at or above it are
            embedding padding and never eligible).
        answer_prefix_text: text the answer opener ends with, prepended to the
            answer content for scoring.
    """
    name: str
    digest: str
    spec: dict
    openers: tuple[tuple[int, ...], ...]
    closers: tuple[tuple[int, ...], ...]
    special_ids: frozenset[int]
    vocab_size: int
    answer_prefix_text: str
    _tokenizer: PreTrainedTokenizerBase = dataclasses.field(repr=False, compare=False)

    # ---------------------------------------------------------------- prompt
    def prompt_ids(self, question: str, options: Sequence[str]) -> list[int]:
        """Token IDs of the prompt block (role 0) for one problem.

        Raises:
            ContractError: if the problem text tokenizes to a special token
                (it would be mistaken for a delimiter), naming the field
                (``question`` or ``option B``) and the token's text and ID.
        """
        letters = "ABCDEFGHIJ"
        opts = "\n".join(f"{letters[i]}. {o}" for i, o in enumerate(options))
        user = self.spec["question"].format(question=question.strip(), options=opts)
        tok = self._tokenizer
        content_ids = tok(user, add_special_tokens=False).input_ids
        if any(t in self.special_ids for t in content_ids):
            fields = [("question", question.strip())] + [(f"option {letters[i]}", o) for i, o in enumerate(options)]
            for name, text in fields + [("the prompt text around the fields", user)]:
                bad = [t for t in tok(text, add_special_tokens=False).input_ids if t in self.special_ids]
                if bad:
                    shown = ", ".join(f"{tok.convert_ids_to_tokens(t)!r} (ID {t})" for t in dict.fromkeys(bad))
                    raise ContractError(f"field '{name}' contains the special token(s) {shown}; a special token in "
                                        f"the problem text would be read as a delimiter. Remove or rephrase it")
        if self.spec["kind"] == "chat_template":
            msgs = [{"role": "system", "content": self.spec["system"]}, {"role": "user", "content": user}]
            text = _render(tok, msgs, generation_prompt=False)
            return tok(text, add_special_tokens=False).input_ids
        return list(_ids(tok, self.spec["prompt_open"])) + content_ids + list(_ids(tok, self.spec["prompt_close"]))

    def delimiter_tokens(self) -> int:
        """Number of tokens in all opening and closing delimiters of blocks 1..5 together (each appears once per sequence)."""
        return sum(len(self.openers[r]) + len(self.closers[r]) for r in range(BRANCH1, ANSWER + 1))

    def max_sequence_length(self, prompt_len: int, caps: Caps) -> int:
        """Tokens of the longest full sequence this format can produce for a prompt: an upper bound on positions.

        prompt + every opening and closing delimiter + 3 x ``caps.branch`` +
        ``caps.merge`` + ``caps.answer`` (a block's content stops at its cap,
        after which its closing delimiter is forced). Every position ID of a
        row (live, incremental, prefill, replicas and suffixes) is below it.

        Args:
            prompt_len: tokens of the prompt block (role 0).
            caps: the content caps.

        Returns:
            The length in tokens (int).
        """
        return prompt_len + self.delimiter_tokens() + 3 * caps.branch + caps.merge + caps.answer

    # ----------------------------------------------------------------- parse
    def parse(self, ids: Sequence[int], *, where: str = "sequence") -> Parsed:
        """Rebuild roles and block spans from token IDs (the one parser).

        The prompt block is everything before the first occurrence of the
        branch-1 opener; after it, the six blocks must follow the contract
        exactly (content = non-special tokens, delimiters as specified). A
        sequence may stop anywhere (a prefix); a closing delimiter may be cut
        off only at the sequence's end.

        Args:
            ids: flat token IDs of one copy (no batch dimension).
            where: label used in error messages (e.g. a problem ID).

        Raises:
            ContractError: naming the position and what was expected.
        """
        ids = list(ids)
        op1 = list(self.openers[BRANCH1])
        start = _find(ids, op1)
        if start is None:
            raise ContractError(f"{where}: no branch-1 opening delimiter found; not a multi-branch sequence")
        roles = [PROMPT] * start
        content: dict[int, tuple[int, int] | None] = {r: None for r in range(1, 6)}
        boundary = None
        complete = False
        i = start
        n = len(ids)
        for role in range(1, 6):
            if i >= n:
                break
            opener = self.openers[role]
            got = ids[i : i + len(opener)]
            if got != list(opener[: len(got)]):
                raise ContractError(
                    f"{where}: expected the {ROLE_NAMES[role]} opening delimiter at token {i}, found {got[:8]}..."
                )
            roles += [role] * len(got)
            i += len(got)
            if len(got) < len(opener):
                break
            if role == MERGE:
                boundary = i
            c0 = i
            closer = self.closers[role]
            while i < n and ids[i] != closer[0]:
                if ids[i] in self.special_ids or ids[i] >= self.vocab_size:
                    raise ContractError(
                        f"{where}: token {ids[i]} at position {i} inside the {ROLE_NAMES[role]} block is special"
                    )
                roles.append(role)
                i += 1
            content[role] = (c0, i)
            got = ids[i : i + len(closer)]
            if got != list(closer[: len(got)]):
                raise ContractError(f"{where}: malformed {ROLE_NAMES[role]} closing delimiter at token {i}: {got}")
            roles += [role] * len(got)
            i += len(got)
            if len(got) < len(closer):
                break
            complete = role == ANSWER
        if i < n:
            raise ContractError(f"{where}: {n - i} tokens after the closed answer block (from position {i})")
        return Parsed(tuple(roles), content, boundary, start, complete)

    def boundary_parse(self, prefix: Sequence[int], *, where: str = "prefix") -> Parsed:
        """Parse a boundary prefix z and check it ends right after the merge opener.

        Raises:
            ContractError: if the prefix lacks the complete merge opening
                delimiter or continues past it.
        """
        p = self.parse(prefix, where=where)
        if p.boundary is None:
            raise ContractError(f"{where}: prefix lacks the boundary (no complete merge opening delimiter)")
        if p.boundary != len(prefix):
            raise ContractError(
                f"{where}: prefix continues {len(prefix) - p.boundary} tokens past the boundary at {p.boundary}"
            )
        return p

    def content_mask(self, role: int, device: torch.device | str = "cpu", width: int | None = None) -> torch.Tensor:
        """Structural logits mask inside an open block of ``role``.

        Returns:
            ``[width]`` bool tensor (``width`` defaults to ``vocab_size``; pass
            the model's logit width, which may be larger), true for every
            non-special tokenizer entry and for the block's closing token.
        """
        width = width or self.vocab_size
        m = torch.zeros(width, dtype=torch.bool, device=device)
        m[: self.vocab_size] = True
        m[sorted(i for i in self.special_ids if i < width)] = False
        m[self.closers[role][0]] = True
        return m


def _find(seq: list[int], sub: list[int]) -> int | None:
    n = len(sub)
    for i in range(len(seq) - n + 1):
        if seq[i : i + n] == sub:
            return i
    return None


def _render(tok, messages: list[dict], generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _ids(tok, text: str) -> tuple[int, ...]:
    return tuple(tok(text, add_special_tokens=False).input_ids)


def _special_ids(tok) -> frozenset[int]:
    ids = set(tok.all_special_ids)
    for i, added in getattr(tok, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(i))
    return frozenset(ids)


def load_spec(fmt: str | Path | dict = "chat_multibranch") -> dict:
    """Read a format spec: a name under ``kvreplay/formats``, a YAML path, or the spec itself (as a ledger key holds it).

    Raises:
        FileNotFoundError: naming the format and where it was looked for.
    """
    if isinstance(fmt, dict):
        return dict(fmt)
    p = Path(fmt)
    if not p.suffix:
        p = FORMATS / f"{fmt}.yaml"
    if not p.is_file():
        raise FileNotFoundError(f"block format {fmt!r} not found (looked for {p})")
    return yaml.safe_load(p.read_text())


def resolve_format(tokenizer, fmt: str | Path | dict = "chat_multibranch") -> BlockFormat:
    """Resolve a format spec against a tokenizer (paper §3.1 delimiters).

    ``kind: chat_template`` renders every delimiter through the tokenizer's
    own chat template: a branch opener is a user turn carrying the branch's
    instruction followed by the assistant generation prompt. The closing
    delimiter is whatever the template appends after assistant content (it
    must begin with a special token, the model's end-of-turn token).
    ``kind: tokens`` gives every delimiter as literal text (e.g. dedicated
    special tokens of an adapted checkpoint, or a model's turn tokens): an
    opener is ``open[block]`` with the block's instruction put where it says
    ``{instruction}``, or appended when it does not.

    An optional ``special_tokens`` list names tokens the format treats as
    special although the tokenizer does not mark them so (Gemma 3's GGUF
    tokenizer: ``<start_of_turn>``, ``<end_of_turn>``); each must be one
    token. They may begin a delimiter, never appear inside block content, and
    a problem text holding one is refused.

    Raises:
        ContractError: if the tokenizer has no chat template for a
            ``chat_template`` format, a delimiter does not begin with a
            special token, or a ``special_tokens`` entry is not one token.
    """
    spec = load_spec(fmt) if not isinstance(fmt, dict) else dict(fmt)
    required = {"chat_template": ("name", "system", "question", "branches", "merge", "answer"),
                "tokens": ("name", "question", "branches", "merge", "answer", "prompt_open", "prompt_close", "open", "close")}
    if spec.get("kind") not in required:
        raise ContractError(f"format {spec.get('name', fmt)!r}: 'kind' must be one of {sorted(required)}, got {spec.get('kind')!r}")
    missing = [k for k in required[spec["kind"]] if k not in spec]
    if missing:
        raise ContractError(f"format {spec.get('name', fmt)!r} (kind {spec['kind']}) lacks the key(s) {missing}")
    special = _special_ids(tokenizer)
    for text in spec.get("special_tokens", []):
        ids = _ids(tokenizer, text)
        if len(ids) != 1:
            raise ContractError(f"format {spec.get('name')}: special_tokens entry {text!r} is {len(ids)} tokens "
                                f"{list(ids[:4])}, not one token of the tokenizer")
        special = special | {ids[0]}
    openers: list[tuple[int, ...]] = [()]
    closers: list[tuple[int, ...]] = [()]
    instructions = [*spec["branches"], spec["merge"], spec["answer"]]
    if len(spec["branches"]) != 3:
        raise ContractError(f"format {spec.get('name')}: exactly three branch instructions are required")
    if spec["kind"] == "chat_template":
        if not getattr(tokenizer, "chat_template", None):
            raise ContractError(
                "the tokenizer has no chat template; give a format of kind 'tokens' "
                "(see kvreplay/formats/README.md) with the `format` parameter"
            )
        base = [{"role": "system", "content": spec["system"]}, {"role": "user", "content": "Q"}]
        base_text = _render(tokenizer, base, False)
        for role, instr in enumerate(instructions, start=1):
            prefix = spec.get("answer_prefix", "") if role == ANSWER else ""
            with_turn = base + [{"role": "user", "content": instr}]
            t_open = _render(tokenizer, with_turn, True)
            if not t_open.startswith(base_text):
                raise ContractError("chat template is not prefix-stable; use a format of kind 'tokens'")
            opener_text = t_open[len(base_text) :] + prefix
            marker = "\u2063RESPONSE\u2063"
            t_full = _render(tokenizer, with_turn + [{"role": "assistant", "content": prefix + marker}], False)
            closer_text = t_full[t_full.index(marker) + len(marker) :]
            openers.append(_ids(tokenizer, opener_text))
            closers.append(_ids(tokenizer, closer_text))
    elif spec["kind"] == "tokens":
        for role in range(1, 6):
            name = ROLE_NAMES[role]
            text = spec["open"][name]
            text = text.replace("{instruction}", instructions[role - 1]) if "{instruction}" in text else text + instructions[role - 1]
            openers.append(_ids(tokenizer, text))
            closers.append(_ids(tokenizer, spec["close"][name]))
    else:
        raise ContractError(f"unknown format kind {spec['kind']!r}")
    for role in range(1, 6):
        for kind, seq in (("opening", openers[role]), ("closing", closers[role])):
            if not seq or seq[0] not in special:
                raise ContractError(
                    f"format {spec.get('name')}: the {ROLE_NAMES[role]} {kind} delimiter must begin with a special "
                    f"token, got {seq[:4]}"
                )
    resolved = {"spec": spec, "openers": openers, "closers": closers, "special": sorted(special)}
    digest = hashlib.sha256(json.dumps(resolved, sort_keys=True).encode()).hexdigest()
    return BlockFormat(
        name=spec["name"],
        digest=digest,
        spec=spec,
        openers=tuple(openers),
        closers=tuple(closers),
        special_ids=special,
        vocab_size=len(tokenizer),
        answer_prefix_text=spec.get("answer_prefix", ""),
        _tokenizer=tokenizer,
    )


def visibility_table() -> list[dict]:
    """Table 2 as rows ``{query role, visible key roles}`` generated from :data:`VISIBILITY`."""
    return [
        {"query role": ROLE_NAMES[q], "raw role": q, "embedding row": q + ROLE_OFFSET,
         "may attend to": ", ".join(ROLE_NAMES[k] for k in sorted(VISIBILITY[q]))}
        for q in range(6)
    ]
