"""A request body as the generation routes read it: typed getters that name their field in every error, the
400 that names a body field, and the structured output a body asks for.

Below both `schema` (a route's whole body) and `tools` (a chat body's functions), which read their fields
with the same getters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from serving.errors import ApiError

MAX_STOP = 16
# Unsupported values that ask for nothing, so clients that send their defaults explicitly still work.
HARMLESS = {"stop_regex": [], "spaces_between_special_tokens": True, "no_stop_trim": False,
            "store": False, "include_stop_str_in_output": False, "continue_final_message": False,
            "chat_template_kwargs": {}, "mm_processor_kwargs": {}}


def bad(where: str, message: str) -> ApiError:
    return ApiError(400, f"{where}: {message}", "invalid_request", where)


@dataclass
class BodyConstraint:
    """A structured-output request: `kind` is the engine's name for it (`SamplingParams.constraint`'s key:
    json_schema, json_object, regex, choices or grammar), `spec` the body's schema, pattern, choices or
    grammar (True for json_object), `field` the body field it came from."""

    kind: str
    spec: Any
    field: str

    @property
    def params(self) -> dict[str, Any]:
        """What `SamplingParams(constraint=...)` takes; the engine checks and compiles it."""
        return {self.kind: self.spec}

    def body_field(self, path: str) -> str:
        """The body field at `path` inside the spec (`.properties.tags`; empty for the spec itself)."""
        return self.field + path

    def field_of(self, engine_field: str) -> str:
        """The body field behind an engine error inside this constraint: `constraint.json_schema.properties.tags`
        of a `response_format` schema is `response_format.json_schema.schema.properties.tags`."""
        rest = engine_field.removeprefix("constraint.")
        if rest.startswith((self.kind + ".", self.kind + "[")):
            return self.body_field(rest[len(self.kind):])
        return self.field

    def parts(self) -> list[BodyConstraint]:
        """Pieces to compile alone first, so an error in one names its own field (none: the whole is one)."""
        return []


class Fields:
    """A JSON object being read: each getter checks one field's JSON type and names it on failure."""

    def __init__(self, body: Any, allowed: set[str], prefix: str = "", what: str = "request body"):
        if not isinstance(body, dict):
            raise bad(prefix.rstrip(".") or "body", f"{what} must be a JSON object, got {type(body).__name__}")
        for key, value in body.items():
            if key not in allowed and value is not None:
                raise bad(prefix + key, "not supported by this server")
        self.body = body
        self.prefix = prefix

    def where(self, name: str) -> str:
        return self.prefix + name

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def raw(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        return default if value is None else value

    def number(self, name: str, default: float | None = None) -> float | None:
        value = self.raw(name, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)):
            raise bad(self.where(name), f"must be a number, got {value!r}")
        return value

    def integer(self, name: str, default: int | None = None, *, low: int | None = None,
                high: int | None = None) -> int | None:
        value = self.raw(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad(self.where(name), f"must be an integer, got {value!r}")
        if low is not None and value < low:
            raise bad(self.where(name), f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise bad(self.where(name), f"must be at most {high}, got {value}")
        return value

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise bad(self.where(name), f"must be true or false, got {value!r}")
        return value

    def stop(self, name: str) -> list[str]:
        value = self.raw(name, [])
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(s, str) and s for s in values):
            raise bad(self.where(name), "must be a non-empty string or a list of them")
        if len(values) > MAX_STOP:
            raise bad(self.where(name), f"at most {MAX_STOP} stop strings, got {len(values)}")
        return values

    def token_ids(self, name: str) -> list[int]:
        value = self.raw(name, [])
        if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise bad(self.where(name), "must be a list of token ids")
        return value

    def logit_bias(self, name: str) -> dict[int, float]:
        """OpenAI's (and SGLang's) token id -> bias object. JSON keys are strings, so an id comes spelled in
        decimal ("50256"); only that spelling and the values' JSON type are checked here, the range and the
        vocabulary are the engine's. One spelling per id (no "007"), so no two keys can name the same token."""
        value = self.raw(name, {})
        if not isinstance(value, dict):
            raise bad(self.where(name), f"must be an object of token ids to biases, got {type(value).__name__}")
        out: dict[int, float] = {}
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 19 and key == str(int(key))):
                raise bad(self.where(name), f"keys must be token ids in decimal, such as \"50256\", got {key!r:.40}")
            if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias):
                raise bad(self.where(name), f"token {key}: the bias must be a number, got {bias!r:.40}")
            out[int(key)] = bias
        return out

    def harmless(self, name: str) -> None:
        """A field taken only at the value that asks for nothing (`HARMLESS`)."""
        if self.has(name) and self.body[name] != HARMLESS[name]:
            raise bad(self.where(name), f"only {HARMLESS[name]!r} is supported")
