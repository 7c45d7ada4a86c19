"""SGLang's `min_new_tokens` (vLLM's `min_tokens`): no stop before a request's first n output tokens.

A stopping token (EOS unless `ignore_eos`, or one of `stop_token_ids`) is masked while the output is shorter
than n, so the model writes on instead of ending; the engine does not look for stop strings before then
either, as both servers do. Masking rather than sampling and then ignoring the stop keeps the tokens the
model wrote a continuation it could have written. Stateless: the output's length says when it is done.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from generation.logits_processor import LogitsProcessor


class MinNewTokens(LogitsProcessor):
    """Masks `stop_ids` until the output holds `n` tokens."""

    def __init__(self, n: int, stop_ids: Iterable[int], device: torch.device | str = "cpu") -> None:
        self.n = n
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor) -> None:
        if len(output_ids) < self.n:
            logits[self.stop_ids.to(logits.device)] = float("-inf")
