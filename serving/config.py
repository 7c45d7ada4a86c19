"""Server configuration: one dataclass, filled from flags, then `PAGODA_*` environment variables, then defaults.

Every limit the server enforces lives here, so an operator can find and change all of them in one place
and an error message can name the flag and the variable that set a bad value.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

SHIPPED_PRESETS = Path(__file__).with_name("presets.yaml")

_UNSET = object()


def _opt(default, help: str, flag: bool = True):
    return field(default=default, metadata={"help": help, "flag": flag})


@dataclass
class ServeConfig:
    model: str | None = _opt(None, "Laya checkpoint folder (default: the embedded laya-mini)")
    student: str | None = _opt(None, "serve a distilled student folder instead of a Laya checkpoint")
    device: str = _opt("cpu", "torch device for the Laya model (cpu, cuda, cuda:1, mps)")
    host: str = _opt("127.0.0.1", "bind address")
    port: int = _opt(8000, "bind port (0 picks a free one)")
    workers: int = _opt(1, "gunicorn worker processes; each holds its own model and model-worker thread")
    threads: int = _opt(64, "request threads per worker; concurrent requests beyond this queue in the kernel")
    presets: str = _opt(str(SHIPPED_PRESETS), "JSON or YAML file of named question sets")
    policy: str | None = _opt(None, "JSON or YAML file of named rules over answers (returned as `actions`)")
    api_key: str | None = _opt(None, "require `Authorization: Bearer <key>` (environment only)", flag=False)
    batching: bool = _opt(True, "batch questions from concurrent requests into shared forward passes")
    max_batch_questions: int = _opt(256, "most question rows in one forward pass")
    max_batch_tokens: int = _opt(65536, "most tokens (rows x padded length) in one forward pass")
    max_wait_ms: float = _opt(5.0, "how long the model worker may wait for requests still being prepared to join "
                                   "a batch (never when none are)")
    max_queue: int = _opt(1024, "most states waiting for the model; past it requests get 503")
    request_timeout_s: float = _opt(30.0, "deadline per request; past it the request gets 504")
    max_body_bytes: int = _opt(1 << 20, "largest request body; past it 413")
    max_states: int = _opt(64, "most states in one /decide/batch request")
    max_questions: int = _opt(64, "most questions in one request")
    max_options: int = _opt(100, "most options of one choice or score question")
    max_state_chars: int = _opt(50000, "longest state, in characters of its JSON text")
    max_len_cap: int = _opt(8192, "largest max_len / head_max_len a request may ask for")
    torch_threads: int = _opt(0, "torch intra-op threads per worker (0: torch's default)")
    graceful_timeout_s: float = _opt(30.0, "on SIGTERM, how long in-flight requests get to finish")
    access_log: bool = _opt(True, "one JSON line per request on stderr")

    def __post_init__(self) -> None:
        for name in ("workers", "threads", "max_batch_questions", "max_batch_tokens", "max_queue",
                     "max_body_bytes", "max_states", "max_questions", "max_options", "max_state_chars",
                     "max_len_cap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{_where(name)} must be at least 1, got {getattr(self, name)}")
        for name in ("max_wait_ms", "torch_threads", "graceful_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{_where(name)} must not be negative, got {getattr(self, name)}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"{_where('request_timeout_s')} must be positive, got {self.request_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"{_where('port')} must be in 0..65535, got {self.port}")
        if self.max_queue < self.max_states:
            raise ValueError(f"{_where('max_queue')} ({self.max_queue}) must be at least {_where('max_states')} "
                             f"({self.max_states}), or a full batch request could never be queued")
        if self.model and self.student:
            raise ValueError("give either --model or --student, not both")

    @classmethod
    def from_sources(cls, flags: Mapping[str, object] | None = None,
                     env: Mapping[str, str] | None = None) -> ServeConfig:
        """Flags win over `PAGODA_<NAME>` variables, which win over the defaults above."""
        flags = flags or {}
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            given = flags.get(f.name, _UNSET)
            if given is not _UNSET and given is not None:
                values[f.name] = given
                continue
            raw = env.get(_env_name(f.name))
            if raw is not None and raw != "":
                values[f.name] = _parse(f, raw)
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, defaulting to None so an unset flag falls through to the environment."""
        for f in dataclasses.fields(cls):
            if not f.metadata.get("flag", True):
                continue
            name = "--" + f.name.replace("_", "-")
            help_text = f"{f.metadata['help']} [env {_env_name(f.name)}; default {f.default}]"
            kind = _kind(f)
            if kind is bool:
                parser.add_argument(name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
            else:
                parser.add_argument(name, type=kind, default=None, help=help_text)


def _env_name(name: str) -> str:
    return "PAGODA_" + name.upper()


def _where(name: str) -> str:
    return f"--{name.replace('_', '-')} / {_env_name(name)}"


def _kind(f: dataclasses.Field) -> type:
    text = str(f.type)
    for kind in (bool, int, float):
        if text.startswith(kind.__name__):
            return kind
    return str


def _parse(f: dataclasses.Field, raw: str) -> object:
    kind = _kind(f)
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{_env_name(f.name)} must be a boolean (1/0, true/false), got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{_env_name(f.name)} must be {kind.__name__}, got {raw!r}") from None
