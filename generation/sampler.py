"""Turn last-position logits into next tokens, one request's settings per row.

Every greedy row without penalties, with or without logits processors, takes its token from one argmax
over the whole batch, taken after the processors edited their rows in place (a grammar's mask is one add
of a 0/-inf bias over its rows); rows with penalties or sampling go row by row, because each may carry
its own penalties, filters and random generator. Seeded rows draw from their own `torch.Generator`, so a
request's tokens do not depend on what else shares the batch. Processors only ever touch their own rows,
so rows without processors see exactly the logits they would have seen alone; log-probabilities are
taken from the raw logits (a row with processors that asks for them is copied first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from generation.sequence import Sequence


@dataclass
class Sampled:
    """Per row: the token (None where a processor failed), a logprob record if asked, and failures by row."""

    tokens: list[int | None]
    records: list[dict[str, Any] | None]
    errors: dict[int, str]


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    device = logits.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.all_ids)), dtype=torch.long, device=device)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.output_ids:
        ids, counts = torch.tensor(seq.output_ids, device=device).unique(return_counts=True)
        logits[ids] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
    return logits


def _filter(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= p.top_p  # keep the token that crosses top_p
        drop[0] = False  # and always the most likely: a top_p under float32's smallest number rounds to 0
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def logprob_record(logits: torch.Tensor, token: int, k: int) -> dict[str, Any]:
    """The log-probability of `token` under one row of raw logits, plus the `k` most likely tokens."""
    logprobs = torch.log_softmax(logits, -1)
    out: dict[str, Any] = {"token_id": token, "logprob": float(logprobs[token])}
    if k:
        vals, ids = torch.topk(logprobs, k)
        out["top"] = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return out


def _describe(exc: Exception, proc: object) -> str:
    return f"logits processor {type(proc).__name__}: {type(exc).__name__}: {exc}"


def _run_processors(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> dict[int, str]:
    """Run the processors of `rows` on their rows of `logits`, in place; returns the rows whose processor raised.

    Position j of every row's processor list runs as one `apply_batch` call per class, so per-row order
    is kept and a grammar engine sees all its rows at once."""
    errors: dict[int, str] = {}
    for j in range(max(len(seqs[i].processors) for i in rows)):
        groups: dict[type, list[int]] = {}
        for i in rows:
            if i not in errors and j < len(seqs[i].processors):
                groups.setdefault(type(seqs[i].processors[j]), []).append(i)
        for cls, members in groups.items():
            picked = [seqs[i] for i in members]
            procs = [s.processors[j] for s in picked]
            try:
                cls.apply_batch(procs, [s.prompt_ids for s in picked], [s.output_ids for s in picked], logits, members)
            except Exception as exc:  # the failure ends these requests only
                errors.update({i: _describe(exc, procs[0]) for i in members})
    return errors


def _accept(seqs: list[Sequence], tokens: list[int | None], errors: dict[int, str]) -> None:
    for i, seq in enumerate(seqs):
        if tokens[i] is None:
            continue
        for proc in seq.processors:
            try:
                proc.accept(tokens[i])
            except Exception as exc:
                errors[i] = _describe(exc, proc)
                tokens[i] = None
                break


@torch.inference_mode()  # the runner's logits are inference tensors, which only inference mode edits in place
def sample(logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
    """Next token per row of `logits` ([N, vocab]), plus logprob records for rows asking.

    The rows of sequences with processors are edited in place (the engine reads no sampled row again)."""
    logits = logits.float()
    n = len(seqs)
    tokens: list[int | None] = [None] * n
    rows = [i for i, s in enumerate(seqs) if s.processors]
    raw = {i: logits[i].clone() for i in rows if seqs[i].params.logprobs is not None}
    errors = _run_processors(logits, seqs, rows) if rows else {}
    # one argmax for every greedy row without penalties: the plain ones and those whose processors just ran
    fast = [i for i, s in enumerate(seqs) if s.params.greedy and not s.params.penalized and i not in errors]
    if fast:
        top = logits.argmax(-1)
        picked = top.tolist()
        for i in fast:
            tokens[i] = picked[i]
    if rows:  # a row whose processors left no token open cannot sample; its max is -inf
        top = top if fast else logits.argmax(-1)
        best = logits.gather(1, top.unsqueeze(1)).squeeze(1).tolist()
        for i in rows:
            if i not in errors and best[i] == float("-inf"):
                errors[i] = "logits processors masked every token"
                tokens[i] = None
    for i, seq in enumerate(seqs):
        if tokens[i] is not None or i in errors:
            continue
        row = _apply_penalties(logits[i].clone(), seq)
        if seq.params.greedy:
            tokens[i] = int(row.argmax())
            continue
        row = _filter(row / seq.params.temperature, seq)
        probs = row.softmax(-1)
        try:
            tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
        except RuntimeError as exc:  # this row's numbers, not the batch's: its mates go on
            errors[i] = f"sampling failed: {exc}"
            tokens[i] = None
    _accept(seqs, tokens, errors)
    records: list[dict[str, Any] | None] = [None] * n
    for i, seq in enumerate(seqs):
        if seq.params.logprobs is not None and tokens[i] is not None:
            records[i] = logprob_record(raw.get(i, logits[i]), tokens[i], seq.params.logprobs)
    return Sampled(tokens, records, errors)
