"""Bundled LLM engine: a Llama-family model over a paged KV pool with prefix caching and continuous batching.

Importing this package is cheap; torch loads when an engine module is first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from generation.config import EngineConfig, InvalidParam, SamplingParams
from generation.logits_processor import LogitsProcessor

if TYPE_CHECKING:
    from generation.engine import Engine, GenerationOutput, TokenEvent
    from generation.engine_loop import BatchHandle, EngineLoop, QueueFull, RequestHandle
    from generation.session import Session

_LAZY = {
    "Engine": "generation.engine", "GenerationOutput": "generation.engine", "TokenEvent": "generation.engine",
    "EngineLoop": "generation.engine_loop", "QueueFull": "generation.engine_loop",
    "RequestHandle": "generation.engine_loop", "BatchHandle": "generation.engine_loop",
    "Session": "generation.session",
}

__all__ = ["EngineConfig", "SamplingParams", "InvalidParam", "LogitsProcessor", "Engine", "GenerationOutput",
           "TokenEvent", "EngineLoop", "QueueFull", "RequestHandle", "BatchHandle", "Session"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
