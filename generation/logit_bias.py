"""OpenAI's `logit_bias` as a logits processor: fixed numbers added to chosen tokens' raw logits.

The engine puts one first in the processors of a sequence whose `SamplingParams.logit_bias` is set, so it
edits the raw logits and a grammar's 0/-inf mask comes after it: a banned token stays banned whatever its
bias (-inf + 100 is -inf). A bias is the same at every step, so the processor is stateless and the tensors
are built once, when the request is added, not per step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from generation.logits_processor import LogitsProcessor


class LogitBias(LogitsProcessor):
    """Adds `bias[token]` to each listed token's logit, every step."""

    def __init__(self, bias: Mapping[int, float], device: torch.device | str = "cpu") -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long, device=device)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32, device=device)

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor) -> None:
        logits.index_add_(0, self.ids.to(logits.device), self.values.to(logits.device, logits.dtype))

    @classmethod
    def apply_batch(cls, processors: list[LogitsProcessor], prompt_ids: list[Sequence[int]],
                    output_ids: list[Sequence[int]], logits: torch.Tensor, rows: list[int]) -> None:
        """Every biased row of the step in one indexed add, touching only those rows' listed tokens."""
        biases: list[LogitBias] = processors  # type: ignore[assignment]
        device = logits.device
        counts = torch.tensor([b.ids.numel() for b in biases])
        at = torch.repeat_interleave(torch.tensor(rows), counts).to(device)
        ids = torch.cat([b.ids for b in biases]).to(device)
        values = torch.cat([b.values for b in biases]).to(device, logits.dtype)
        logits.index_put_((at, ids), values, accumulate=True)
