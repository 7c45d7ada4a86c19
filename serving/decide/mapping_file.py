"""Operator files (presets, policies): a JSON or YAML mapping of names, read once at startup.

Errors name the file and what it was for, so a bad `--presets` or `--policy` stops the deploy with a line
an operator can act on; they are `ValueError`s, which `pagoda serve` reports before gunicorn forks.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml


def read_mapping(path: str | Path, what: str) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {what} file {path}: {exc.strerror}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{what} file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} file {path} must hold a mapping of names, got {type(data).__name__}")
    return data
