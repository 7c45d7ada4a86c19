"""One request as the scheduler sees it.

A sequence's KV lives in pool blocks listed in `block_table`; `num_computed` says how many of its
tokens already have KV there (from a cache hit or from earlier steps). Everything the scheduler,
runner and sampler need about a request is here, so preemption is just "drop the blocks, set
num_computed to 0, requeue": the tokens generated so far stay and are recomputed as prompt.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from generation.config import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    index: int = 0
    request_id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    emitted_text_len: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    generator: torch.Generator | None = None
    cache_handle: Any = None
    checkpoint: Any = None
    admissions: int = 0
    prefill_only: bool = False  # checkpoint building: compute KV, sample nothing
    keep_kv: bool = False  # checkpoint or session takes over the blocks when it finishes

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
    def salt(self) -> str | None:
        return self.params.cache_salt
