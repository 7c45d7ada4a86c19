"""Rows -> one packed token axis, the input of the CPU engines (onnxruntime's graph, the bf16 engine).

Padding (`laya.batching`) makes a row's tensors depend on the longest row it shares a batch with;
packing lays rows one after another without padding, so no FLOP is spent on padding and nothing a
row is computed from depends on the others. Torch-free: the onnxruntime engine runs without it.

How many tokens one run takes: 512 per intra-op thread, at most 4,096 (which bounds activation memory).
One thread runs a long packed call fastest in ~512-token chunks (each GEMM's activations stay
cache-sized: at 4,096 tokens base-size int8 ran 0.87x as fast as request by request), while more threads
need longer chunks to keep them all busy (2 threads: 1.6x at 1,024-4,096 tokens, 1.4x at 512). Measured
on a base-size and the laya-mini checkpoint, docs/benchmarks.md#serving.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from laya.rows import Row

TOKENS_PER_THREAD = 512
MAX_TOKENS = 4096


def chunk_tokens(threads: int) -> int:
    """The token budget of one run for `threads` intra-op threads (0: one per core)."""
    return min(MAX_TOKENS, TOKENS_PER_THREAD * max(1, threads or os.cpu_count() or 1))


def token_chunks(rows: list[Row], budget: int) -> Iterator[list[Row]]:
    """Consecutive runs of rows of at most `budget` tokens each (a longer row runs alone)."""
    start = 0
    while start < len(rows):
        end, tokens = start, 0
        while end < len(rows) and (end == start or tokens + rows[end].n_tokens <= budget):
            tokens += rows[end].n_tokens
            end += 1
        yield rows[start:end]
        start = end


@dataclass
class Packed:
    """R rows as one token axis of T tokens, and where each row's [CLS] and option markers sit in it."""

    input_ids: np.ndarray       # [T] token ids, rows one after another
    positions: np.ndarray       # [T] position of each token in its own row
    token_qtype: np.ndarray     # [T] question type of each token's row
    row_starts: np.ndarray      # [R+1] where each row begins in the token axis (last entry: T)
    select: np.ndarray          # [P] token index of each row's [CLS] then its option markers, rows in order
    select_starts: np.ndarray   # [R+1] where each row's entries begin in `select`
    marker_select: np.ndarray   # [M] positions in `select` of the option markers
    cls_select: np.ndarray      # [R] positions in `select` of the [CLS] tokens
    marker_counts: list[int]    # options of each row


def pack(rows: list[Row]) -> Packed:
    lengths = np.array([r.n_tokens for r in rows], dtype=np.int64)
    row_starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lengths, out=row_starts[1:])
    picks = [np.concatenate([[0], r.markers]).astype(np.int64) + row_starts[i] for i, r in enumerate(rows)]
    select_starts = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(p) for p in picks], out=select_starts[1:])
    is_cls = np.zeros(select_starts[-1], dtype=bool)
    is_cls[select_starts[:-1]] = True
    return Packed(
        input_ids=np.fromiter((t for r in rows for t in r.input_ids), dtype=np.int64, count=int(row_starts[-1])),
        positions=np.concatenate([np.arange(n, dtype=np.int64) for n in lengths]),
        token_qtype=np.repeat(np.array([r.qtype for r in rows], dtype=np.int64), lengths),
        row_starts=row_starts,
        select=np.concatenate(picks),
        select_starts=select_starts,
        marker_select=np.flatnonzero(~is_cls).astype(np.int64),
        cls_select=select_starts[:-1].copy(),
        marker_counts=[len(r.markers) for r in rows])
