"""Turn last-position logits into next tokens, one request's settings per row.

A batch of plain greedy rows is a single argmax; anything else goes row by row, because each row may
carry its own penalties, filters and random generator. Seeded rows draw from their own
`torch.Generator`, so a request's tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

from typing import Any

import torch

from generation.sequence import Sequence


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
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def _logprobs(logprobs: torch.Tensor, token: int, k: int) -> dict[str, Any]:
    out: dict[str, Any] = {"token_id": token, "logprob": float(logprobs[token])}
    if k:
        vals, ids = torch.topk(logprobs, k)
        out["top"] = [(int(i), float(v)) for i, v in zip(ids.tolist(), vals.tolist())]
    return out


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[dict[str, Any] | None]]:
    """Next token per row of `logits` ([N, vocab], float32), plus logprob records for rows asking."""
    logits = logits.float()
    tokens: list[int | None] = [None] * len(seqs)
    plain = [i for i, s in enumerate(seqs) if s.params.plain_greedy]
    if plain:
        picked = logits[plain].argmax(-1).tolist()
        for i, t in zip(plain, picked):
            tokens[i] = t
    for i, seq in enumerate(seqs):
        if tokens[i] is not None:
            continue
        row = _apply_penalties(logits[i].clone(), seq)
        if seq.params.greedy:
            tokens[i] = int(row.argmax())
            continue
        row = _filter(row / seq.params.temperature, seq)
        probs = row.softmax(-1)
        tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
    records: list[dict[str, Any] | None] = [None] * len(seqs)
    for i, seq in enumerate(seqs):
        if seq.params.logprobs is not None:
            records[i] = _logprobs(torch.log_softmax(logits[i], -1), tokens[i], seq.params.logprobs)
    return tokens, records
