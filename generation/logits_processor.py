"""The hook through which a request edits its own next-token logits: bans, biases, grammar masks.

A processor is an object in `SamplingParams.logits_processors`. The contract, which the engine keeps:

- **One fork per sequence.** The objects in `SamplingParams` are prototypes; when a request is added, each
  one's `fork()` is called and the sequence keeps the forks. Per-sequence state (a grammar matcher) lives on
  the fork, so one `SamplingParams` can serve a whole batch of prompts. A stateless processor returns
  `self` (the default).
- **Called on the raw logits of every step the sequence samples**, before penalties, temperature and the
  top-k/top-p/min-p filters, with the sequence so far: `prompt_ids` (including a pin's tokens) and
  `output_ids`. It edits the float32 row in place (`logits[ids] = -inf`). Log-probabilities reported to
  the caller stay those of the raw model distribution.
- **`accept(token_id)` once per sampled token, in order**, after every processor of the step ran; the
  end-of-sequence token is accepted too (a grammar needs it to terminate). The engine never takes a
  sampled token back: preemption recomputes the KV of the tokens already generated instead of sampling
  them again, so a fork's state stays valid across preemption; `output_ids` is always passed in full,
  so a processor that doubts its state can rebuild it from them.
- **Batched by class.** Each step, the processors at list position j of all sampling rows are grouped by
  class and handed to `type(p).apply_batch` in one call, so a grammar engine fills one token bitmask for
  all its rows and applies it with one kernel. The default `apply_batch` calls each processor on its row.
- **Failures stay with their request.** An exception from a processor ends only the requests whose rows
  it was processing (finish reason `"error"`, the message in the output); the rest of the batch samples
  as if nothing happened.

Rows without processors never pass through this code, and plain greedy rows among them keep the fused
argmax fast path, so adding a constrained request to a batch cannot change anyone else's tokens.

Allowing end-of-sequence exactly when a grammar can end is the processor's job: mask the stop token ids
while the grammar is incomplete and everything else once only ending is possible; the engine stops on the
sampled stop token as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class LogitsProcessor:
    """Base class of logits processors; subclass and implement `__call__` (and `fork`/`accept` if stateful)."""

    def fork(self) -> LogitsProcessor:
        """The instance one new sequence will use; stateful processors return a fresh copy of their state."""
        return self

    def __call__(self, prompt_ids: Sequence[int], output_ids: Sequence[int], logits: torch.Tensor) -> None:
        """Edit `logits` ([vocab] float32, this sequence's next-token row) in place."""
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(prompt_ids, output_ids, logits)")

    def accept(self, token_id: int) -> None:
        """The token sampled for this sequence (called after every processor of the step ran)."""

    @classmethod
    def apply_batch(cls, processors: list[LogitsProcessor], prompt_ids: list[Sequence[int]],
                    output_ids: list[Sequence[int]], logits: torch.Tensor, rows: list[int]) -> None:
        """Edit `logits[rows[i]]` for `processors[i]` in place; override to process all rows of a class at once."""
        for proc, prompt, output, row in zip(processors, prompt_ids, output_ids, rows):
            proc(prompt, output, logits[row])
