"""Settings declared once, as dataclass fields, and read from flags, then `PAGODA_*` variables, then defaults.

A field carries its help text and its bounds; the flag, the environment variable, the `--help` line and
the error that names a bad value are all generated from it. So an API that adds twenty settings writes
twenty fields and nothing else: its settings are a `Settings` dataclass of its own, which `ServeConfig`
composes as a section, and its `PREFIX` (empty for the decision API, whose flags predate sections) keeps
its flags and variables apart from other APIs'.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import field
from typing import Any, ClassVar

# Any torch thread count's ceiling, for the settings beside MAX_SECONDS: generation's own, since its CLIs cannot
# import serving and one number must bound both.
from generation.config import MAX_TORCH_THREADS as MAX_TORCH_THREADS

_UNSET = object()
# Any duration setting's ceiling (11.6 days) unless its field declares one: past ~9.2e9 s the thread and timer
# waits it reaches raise OverflowError on every request instead of once at startup.
MAX_SECONDS = 1e6


def option(default: Any, help: str, *, env_only: bool = False, minimum: float | None = None,
           maximum: float | None = None, positive: bool = False) -> Any:
    """A setting. `env_only` keeps it off the command line (secrets must not show in `ps`)."""
    return field(default=default, metadata={"help": help, "flag": not env_only, "minimum": minimum,
                                            "maximum": maximum, "positive": positive})


def section(settings: type[Settings]) -> Any:
    """An API's own settings inside `ServeConfig`."""
    return field(default_factory=settings, metadata={"section": True})


class Settings:
    """Base of a settings dataclass: bounds checked on construction, sources read by `from_sources`."""

    PREFIX: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if meta.get("section") or value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):  # NaN passes every comparison below
                raise ValueError(f"{self.where(f.name)} must be a finite number, got {value}")
            low, high = meta.get("minimum"), meta.get("maximum")
            cap = MAX_SECONDS * (1000 if f.name.endswith("_ms") else 1)
            if high is None and f.name.endswith(("_s", "_ms")) and value > cap:
                raise ValueError(f"{self.where(f.name)} must be at most {cap:g}, got {value}")
            if low is not None and high is not None and not low <= value <= high:
                raise ValueError(f"{self.where(f.name)} must be in {low}..{high}, got {value}")
            if low is not None and value < low:
                rule = "must not be negative" if low == 0 else f"must be at least {low}"
                raise ValueError(f"{self.where(f.name)} {rule}, got {value}")
            if meta.get("positive") and value <= 0:
                raise ValueError(f"{self.where(f.name)} must be positive, got {value}")

    @classmethod
    def where(cls, name: str) -> str:
        """How an operator sets `name`: the flag and the variable, for error messages."""
        dest = cls.PREFIX + name
        return f"--{dest.replace('_', '-')} / {_env_name(dest)}"

    @classmethod
    def from_sources(cls, flags: Mapping[str, object] | None = None, env: Mapping[str, str] | None = None):
        """Flags (keyed by argparse dest) win over `PAGODA_<DEST>` variables, which win over the defaults."""
        flags = flags or {}
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            if f.metadata.get("section"):
                values[f.name] = f.default_factory.from_sources(flags, env)
                continue
            dest = cls.PREFIX + f.name
            given = flags.get(dest, _UNSET)
            if given is not _UNSET and given is not None:
                values[f.name] = given
                continue
            raw = env.get(_env_name(dest))
            if raw is not None and raw != "":
                values[f.name] = _parse(f, dest, raw)
        return cls(**values)

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field, defaulting to None so an unset flag falls through to the environment.
        Two sections declaring the same flag fail here (argparse refuses the duplicate)."""
        for f in dataclasses.fields(cls):
            if f.metadata.get("section"):
                f.default_factory.add_arguments(parser)
                continue
            if not f.metadata.get("flag", True):
                continue
            dest = cls.PREFIX + f.name
            help_text = f"{f.metadata['help']} [env {_env_name(dest)}; default {f.default}]"
            kind = _kind(f)
            name = "--" + dest.replace("_", "-")
            if kind is bool:
                parser.add_argument(name, dest=dest, action=argparse.BooleanOptionalAction, default=None,
                                    help=help_text)
            else:
                parser.add_argument(name, dest=dest, type=kind, default=None, help=help_text)


def _env_name(dest: str) -> str:
    return "PAGODA_" + dest.upper()


def _kind(f: dataclasses.Field) -> type:
    text = str(f.type)
    for kind in (bool, int, float):
        if text.startswith(kind.__name__):
            return kind
    return str


def _parse(f: dataclasses.Field, dest: str, raw: str) -> object:
    kind = _kind(f)
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{_env_name(dest)} must be a boolean (1/0, true/false), got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{_env_name(dest)} must be {kind.__name__}, got {raw!r}") from None
