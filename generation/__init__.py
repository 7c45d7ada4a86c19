"""Bundled LLM engine: a Llama-family model over a paged KV pool with prefix caching and continuous batching.

Importing this package is cheap; torch loads when an `Engine` is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from generation.config import EngineConfig, SamplingParams

if TYPE_CHECKING:
    from generation.engine import Engine, GenerationOutput, Session, TokenEvent

__all__ = ["Engine", "EngineConfig", "SamplingParams", "GenerationOutput", "TokenEvent", "Session"]


def __getattr__(name: str):
    if name in ("Engine", "GenerationOutput", "Session", "TokenEvent"):
        from generation import engine

        return getattr(engine, name)
    raise AttributeError(name)
