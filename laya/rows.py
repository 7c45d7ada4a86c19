"""Question + state -> one encoder row (token ids and marker positions), without torch.

Row layout (the released models were trained on it, so it is fixed):
`[CLS] tok("{type} question: {instructions}") [SEP] ([MASK] tok(" " + option))* [SEP] tok(state) [SEP]`.
The head (everything before the state) is capped by `head_max_len`, the whole row by `max_len`. `head_max_len` is a
soft cap, as in the official runtime: the instructions keep `MIN_INSTRUCTION_TOKENS` and each option
`MIN_TOKENS_PER_OPTION` whatever it says (a smaller one is taken, not refused); `max_len` is the hard bound.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from laya.config import DEFAULT_HEAD_MAX_LEN, DEFAULT_MAX_LEN
from laya.errors import InputError, question_error
from laya.questions import Question
from laya.tokenizer import LayaTokenizer

OPTION_MAX_TOKENS = 48
MIN_OPTION_ROOM = 16
MIN_INSTRUCTION_TOKENS = 8
MIN_TOKENS_PER_OPTION = 4


@dataclass(frozen=True)
class Budgets:
    max_len: int = DEFAULT_MAX_LEN
    head_max_len: int = DEFAULT_HEAD_MAX_LEN

    def __post_init__(self):
        for field in ("max_len", "head_max_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"{field}: must be a positive integer, got {value!r}", field=field)


@dataclass
class Row:
    """One question against one state: what the encoder sees plus what usage reports."""

    question: str
    input_ids: list[int]
    markers: list[int]          # [MASK] position of each slot
    qtype: int
    option_labels: tuple        # answer keys in option-index order
    n_options: int
    options_distinct: int       # options that kept a token span of their own after the head cut
    tokens_per_option: int | None
    state_tokens: int
    state_tokens_used: int

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def state_tokens_dropped(self) -> int:
        return self.state_tokens - self.state_tokens_used


def check_state(state: Any, where: str = "state") -> None:
    if not isinstance(state, (str, dict, list)):
        raise InputError(f"{where}: must be a string, a dict or a list of chat turns, got {type(state).__name__}",
                         field=where)


def state_text(state: Any, where: str = "state") -> str:
    """The text a model reads for a state: strings as-is, structured states (dicts, chat turns) as JSON.

    Every reader of states (Laya rows, students, their teachers' labels, serving's size limits) goes
    through here, so a student is shown exactly the text its teacher was.
    """
    check_state(state, where)
    try:
        text = state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)
    except RecursionError:
        raise InputError(f"{where}: nests too deeply to be read as JSON", field=where) from None
    except (ValueError, TypeError) as exc:  # a NaN is fine (Python's json writes it); a circular reference or a
        # value JSON has no type for (a datetime, a set: Python callers only) is not
        raise InputError(f"{where}: cannot be written as JSON: {exc}", field=where) from None
    if not is_text(text):
        raise InputError(f"{where}: contains an unpaired UTF-16 surrogate (not text a tokenizer can read)",
                         field=where)
    return text


def is_text(s: str) -> bool:
    """False for a string with an unpaired surrogate (e.g. from a lone `\\ud800` JSON escape): no UTF-8 form."""
    return s.isascii() or not _SURROGATE.search(s)


_SURROGATE = re.compile("[\ud800-\udfff]")


def encode_head(tok: LayaTokenizer, q: Question) -> tuple[list[int], list[list[int]]]:
    """Budget-independent token ids of a question: instruction ids and one id list per slot."""
    texts = [f"{q.type} question: {q.instructions}"] + [" " + q.options[i] for i in q.slots]
    for i, text in enumerate(texts):
        if not is_text(text):
            field = "instructions" if i == 0 else "criteria"
            raise question_error(q.name, field, "contains an unpaired UTF-16 surrogate (not text a tokenizer "
                                 "can read)")
    ids = tok.encode(texts)
    return ids[0], [o[:OPTION_MAX_TOKENS] for o in ids[1:]]


def build_row(tok: LayaTokenizer, q: Question, head: tuple[list[int], list[list[int]]],
              state_ids: list[int], budgets: Budgets, keep_end: bool) -> Row:
    """Assemble a row from pre-tokenised parts; `keep_end` keeps the newest chat turns."""
    ins_ids, opt_tokens = head
    opts = [[tok.mask_token_id] + o for o in opt_tokens]
    room = budgets.head_max_len - sum(len(o) for o in opts)
    per_option = None
    if room < MIN_OPTION_ROOM:
        per_option = max(MIN_TOKENS_PER_OPTION, (budgets.head_max_len - MIN_OPTION_ROOM) // max(1, len(opts)))
        opts = [o[:per_option] for o in opts]
        room = budgets.head_max_len - sum(len(o) for o in opts)
    ids = [tok.cls_token_id] + ins_ids[: max(MIN_INSTRUCTION_TOKENS, room)] + [tok.sep_token_id]
    markers = []
    for o in opts:
        markers.append(len(ids))
        ids.extend(o)
    ids.append(tok.sep_token_id)
    state_room = max(0, budgets.max_len - len(ids) - 1)
    kept = state_ids[max(0, len(state_ids) - state_room):] if keep_end else state_ids[:state_room]
    ids = (ids + kept + [tok.sep_token_id])[: budgets.max_len]
    surviving = [m for m in markers if m < budgets.max_len]
    if len(surviving) != len(markers):
        raise question_error(
            q.name, "max_len", f"only {len(surviving)} of its {len(markers)} option markers "
            f"fit in max_len={budgets.max_len} with head_max_len={budgets.head_max_len}; raise max_len, "
            "lower head_max_len or use fewer options", at="max_len")
    return Row(q.name, ids, markers, q.qtype, q.keys, len(opts), len({tuple(o) for o in opts}), per_option,
               len(state_ids), len(kept))


def build_rows(tok: LayaTokenizer, state: str | dict | list, questions: list[Question],
               budgets: Budgets, heads: list | None = None) -> list[Row]:
    """All rows of one state; the state is tokenised once and shared by every question."""
    state_ids = tok.encode([state_text(state)])[0]
    heads = heads if heads is not None else [encode_head(tok, q) for q in questions]
    keep_end = isinstance(state, list)
    return [build_row(tok, q, h, state_ids, budgets, keep_end) for q, h in zip(questions, heads)]

