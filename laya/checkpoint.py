"""The official checkpoint folder layout, read and written.

```
rl_agent_config.json        LayaConfig
model.safetensors           all weights, F16 (as released) or F32; loaded into fp32
encoder/config.json         transformers encoder config (ModernBERT or BERT family)
tokenizer/tokenizer.json    + tokenizer/tokenizer_config.json
```
"""

from __future__ import annotations

import json
import os

import torch

from laya.config import LayaConfig
from laya.modeling_laya import LayaModel
from laya.tokenizer import LayaTokenizer

CONFIG_FILE = "rl_agent_config.json"
WEIGHTS_FILE = "model.safetensors"
ENCODER_CONFIG = os.path.join("encoder", "config.json")


def _require(path: str, name: str) -> str:
    full = os.path.join(path, name)
    if not os.path.isfile(full):
        raise FileNotFoundError(f"checkpoint {path} is missing {name} (looked for {full})")
    return full


def load_checkpoint(path: str) -> tuple[LayaModel, LayaTokenizer, LayaConfig]:
    """(model in fp32 eval mode on CPU, tokenizer, config) from an official-layout folder."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder not found: {path}")
    with open(_require(path, CONFIG_FILE), encoding="utf-8") as f:
        config = LayaConfig.from_dict(json.load(f))
    weights_path = _require(path, WEIGHTS_FILE)
    encoder_config = AutoConfig.from_pretrained(os.path.dirname(_require(path, ENCODER_CONFIG)))
    tokenizer = LayaTokenizer.from_dir(os.path.join(path, "tokenizer"))
    model = LayaModel.from_encoder_config(encoder_config, config, init=False)
    weights = load_file(weights_path)
    check_weights(model, weights, weights_path)
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.float().eval(), tokenizer, config


def check_weights(model: LayaModel, weights: dict[str, torch.Tensor], source: str) -> None:
    """Name what does not fit instead of letting `load_state_dict` print a wall of keys."""
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    wrong = [k for k in expected if k in weights and tuple(weights[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {', '.join(unexpected[:3])})")
        if wrong:
            k = wrong[0]
            parts.append(f"{len(wrong)} shape mismatches (e.g. {k}: checkpoint {tuple(weights[k].shape)}, "
                         f"model {tuple(expected[k].shape)})")
        raise ValueError(f"{source} does not match encoder/config.json and rl_agent_config.json: "
                         + "; ".join(parts))


def save_checkpoint(path: str, model: LayaModel, tokenizer: LayaTokenizer, config: LayaConfig,
                    dtype: torch.dtype = torch.float16) -> None:
    """Write the layout `load_checkpoint` and the official runtime read (F16 weights by default, as released)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(path, WEIGHTS_FILE))
    model.encoder.config.save_pretrained(os.path.join(path, "encoder"))
    tokenizer.save(os.path.join(path, "tokenizer"))
    tmp = os.path.join(path, CONFIG_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config.to_dict(), f, indent=2)
    os.replace(tmp, os.path.join(path, CONFIG_FILE))
