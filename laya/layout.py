"""The official checkpoint folder layout, read without torch.

```
rl_agent_config.json        LayaConfig
model.safetensors           all weights, F16 (as released) or F32; computed in fp32
encoder/config.json         transformers encoder config (ModernBERT or BERT family)
tokenizer/tokenizer.json    + tokenizer/tokenizer_config.json
```

The CPU engines load from here alone; `laya.checkpoint` adds the torch module's load and save.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from laya.config import LayaConfig
from laya.tokenizer import LayaTokenizer

CONFIG_FILE = "rl_agent_config.json"
WEIGHTS_FILE = "model.safetensors"
ENCODER_CONFIG = os.path.join("encoder", "config.json")


def answers_digest(path: str | os.PathLike) -> str:
    """16 hex digits of what sets a checkpoint's answers: its config and its weights. A teacher rebuilt in place
    (`make model` after a new head, temperatures refitted) must not have its old labels resumed as its own, nor
    take a student's unsure answers as if it had taught it. laya-mini's `laya_mini` block is left out: it
    records how the head was made (recipes, run folders), which `make model` rewrites without changing an
    answer, and labels made before that must still resume."""
    h = hashlib.sha256()
    config = os.path.join(path, CONFIG_FILE)
    if os.path.isfile(config):
        answers_from = {k: v for k, v in read_json(config).items() if k != "laya_mini"}
        h.update(json.dumps(answers_from, sort_keys=True).encode())
    weights = os.path.join(path, WEIGHTS_FILE)
    if os.path.isfile(weights):
        with open(weights, "rb") as f:
            h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()[:16]


def encoder_positions(encoder_config: dict[str, Any]) -> int | None:
    """The encoder's positions (`max_position_embeddings`): the most tokens a row may hold; None if not given."""
    positions = encoder_config.get("max_position_embeddings")
    return positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None


def checkpoint_positions(path: str | os.PathLike) -> int | None:
    """`encoder_positions` of the checkpoint folder at `path` from its encoder config alone (no weights, no
    tokenizer: a server documents its limits before its model loads); None where it cannot be read."""
    try:
        return encoder_positions(read_json(os.path.join(path, ENCODER_CONFIG)))
    except (OSError, ValueError, AttributeError):  # AttributeError: a config that is not a JSON object
        return None


def require(path: str, name: str) -> str:
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        raise FileNotFoundError(f"checkpoint {path} is missing {name} (looked for {full})")
    return full


def read_json(path: str) -> Any:
    """A checkpoint's JSON file; a damaged one is a `ValueError` naming it (json's message names no file)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from None


def read_parts(path: str) -> tuple[LayaConfig, dict[str, Any], LayaTokenizer, str]:
    """(config, encoder config as JSON, tokenizer, weights file) of a checkpoint folder, every file checked."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder not found: {path}")
    config = LayaConfig.from_dict(read_json(require(path, CONFIG_FILE)))
    weights_path = require(path, WEIGHTS_FILE)
    encoder_config = read_json(require(path, ENCODER_CONFIG))
    tokenizer = LayaTokenizer.from_dir(os.path.join(path, "tokenizer"))
    return config, encoder_config, tokenizer, weights_path


def check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], source: str) -> None:
    """Name what does not fit instead of letting a loader print a wall of keys."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [k for k in expected if k in found and tuple(found[k]) != tuple(expected[k])]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {', '.join(unexpected[:3])})")
        if wrong:
            k = wrong[0]
            parts.append(f"{len(wrong)} shape mismatches (e.g. {k}: checkpoint {tuple(found[k])}, "
                         f"model {tuple(expected[k])})")
        raise ValueError(f"{source} does not match encoder/config.json and rl_agent_config.json: "
                         + "; ".join(parts))
