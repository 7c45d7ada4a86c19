"""Rows -> the padded tensors `LayaModel` takes.

Kept apart from `laya.rows` so building and validating rows never needs torch (students, serving's
request threads and the torch-free contracts rely on that); only code that runs the model pads.
"""

from __future__ import annotations

from typing import Any

import torch

from laya.rows import Row


def collate(rows: list[Row], pad_id: int, length: int | None = None) -> dict[str, Any]:
    """Pad rows to `length` (default: the longest) into the tensors `LayaModel.forward` takes."""
    n = len(rows)
    length = max(r.n_tokens for r in rows) if length is None else length
    k = max(len(r.markers) for r in rows)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, length), dtype=torch.long)
    marker_pos = torch.zeros((n, k), dtype=torch.long)
    marker_mask = torch.zeros((n, k), dtype=torch.bool)
    for i, r in enumerate(rows):
        input_ids[i, : r.n_tokens] = torch.tensor(r.input_ids, dtype=torch.long)
        attention_mask[i, : r.n_tokens] = 1
        marker_pos[i, : len(r.markers)] = torch.tensor(r.markers, dtype=torch.long)
        marker_mask[i, : len(r.markers)] = True
    qtype = torch.tensor([r.qtype for r in rows], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "marker_pos": marker_pos,
            "marker_mask": marker_mask, "qtype": qtype}
