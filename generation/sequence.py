"""One request as the scheduler sees it, and a pin (computed KV kept alive outside any request).

A sequence's KV lives in pool blocks listed in `block_table`; `num_computed` says how many of its
tokens already have KV there (from a cache hit, a pin, or earlier steps). Everything the scheduler,
runner and sampler need about a request is here, so preemption is just "drop the blocks, set
num_computed to 0, requeue": the tokens generated so far stay and are recomputed as prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from generation.config import SamplingParams

if TYPE_CHECKING:
    import torch

    from generation.logits_processor import LogitsProcessor


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Pin:
    """KV of `tokens` kept resident (never evicted) until unpinned; requests continue it with a full hit.

    `num_computed` may be one short of `tokens`: a finished request's last sampled token has no KV yet.
    A pin unpinned while requests still use it is released when the last of them finishes, because a
    preempted request re-reads the pin's blocks when it is readmitted.
    """

    tokens: list[int]
    blocks: list[int]
    num_computed: int
    handle: Any = None
    salt: str | None = None
    users: int = 0
    unpinned: bool = False


@dataclass(eq=False)  # identity: the scheduler finds sequences in its queues by `is`, not by comparing tokens
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    index: int = 0
    pin: Pin | None = None
    pin_result: bool = False  # when it finishes, its KV becomes a new pin instead of being released
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    matched_stop: int | str | None = None  # what ended a `stop`: a token id or a stop string
    text: str = ""
    emitted_text_len: int = 0
    stop_floor: int = 0  # text written before `min_new_tokens` allowed a stop: no stop string may end inside it
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    prompt_logprobs: list[dict[str, Any] | None] = field(default_factory=list)
    generator: torch.Generator | None = None
    cache_handle: Any = None
    admissions: int = 0
    processors: list[LogitsProcessor] = field(init=False)

    def __post_init__(self) -> None:
        self.processors = [p.fork() for p in self.params.logits_processors]
        if self.params.prompt_logprobs is not None and self.params.prompt_logprobs_start == 0:
            self.prompt_logprobs.append(None)  # the first token has no context to be scored in

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens without KV yet; exactly 1 means the sequence can ride in the batched decode forward."""
        return len(self) - self.num_computed

    @property
    def prefill_only(self) -> bool:
        """Compute the prompt's KV and sample nothing (`max_new_tokens=0`: pins, prefix warm-up, scoring)."""
        return self.params.max_new_tokens == 0

    @property
    def prompt_logits_from(self) -> int | None:
        """First position whose logits the prompt log-probabilities still need (each scores the next token).

        The scheduler caps cache hits here and the runner computes logits from here to the prompt's end;
        records already taken survive preemption, so a readmission resumes where it stopped."""
        if self.params.prompt_logprobs is None:
            return None
        nxt = self.params.prompt_logprobs_start + len(self.prompt_logprobs)  # next prompt index to score
        return nxt - 1 if nxt < len(self.prompt_ids) else None

    @property
    def salt(self) -> str | None:
        return self.params.cache_salt
