"""Presets: named question sets loaded from a file, so clients send `{"state": ..., "preset": NAME}`.

Every preset is checked against the server's request limits at startup, so a broken preset stops the
server with an error naming it rather than failing each request that uses it.
"""

from __future__ import annotations

from pathlib import Path

from serving.config import ServeConfig
from serving.errors import ApiError
from serving.policy import read_mapping
from serving.schema import check_questions


def load_presets(path: str | Path, cfg: ServeConfig) -> dict[str, dict]:
    data = read_mapping(path, "presets")
    for name, questions in data.items():
        try:
            check_questions(questions, cfg)
        except ApiError as exc:
            raise ValueError(f"preset {name!r} in {path}: {exc.field}: {exc.message}") from None
        if not questions:
            raise ValueError(f"preset {name!r} in {path}: has no questions")
    return data
