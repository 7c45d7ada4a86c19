"""A conversation whose KV stays resident: each turn computes only the tokens it adds.

Built on the engine's public pin API alone: every turn continues the previous turn's pin and leaves a
new one behind (`pin_result=True`) that covers the whole history, reply included; the old pin is then
let go. The engine drives itself during `send`, so a session is for callers that own the engine (an
`EngineLoop` offers the same through `submit(..., pin=..., pin_result=True)` and `unpin`).
"""

from __future__ import annotations

from dataclasses import replace

from generation.config import SamplingParams
from generation.engine import Engine, GenerationOutput, Prompt


class Session:
    def __init__(self, engine: Engine, cache_salt: str | None = None) -> None:
        self.engine = engine
        self.salt = cache_salt
        self.pin: str | None = None
        self.token_ids: list[int] = []

    def send(self, prompt: Prompt, params: SamplingParams | None = None) -> GenerationOutput:
        """Append `prompt` to the conversation and generate; the reply becomes part of the history."""
        params = params or SamplingParams()
        if params.max_new_tokens < 1:
            raise ValueError("params.max_new_tokens: a session turn must generate at least 1 token")
        if params.cache_salt != self.salt:
            params = replace(params, cache_salt=self.salt)
        (out,) = self.engine.generate([prompt], params, pin=self.pin, pin_result=True)
        if self.pin is not None:
            self.engine.unpin(self.pin)
        self.pin = out.pin
        self.token_ids = out.prompt_token_ids + out.token_ids
        return out

    def close(self) -> None:
        if self.pin is not None:
            self.engine.unpin(self.pin)
            self.pin = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
