"""Checkpoints in the official layout (`laya.layout`) as the torch module `LayaModel`: load and save."""

from __future__ import annotations

import json
import os

import torch

from laya.config import LayaConfig
from laya.layout import CONFIG_FILE, ENCODER_CONFIG, WEIGHTS_FILE, check_shapes, read_parts, require
from laya.modeling_laya import LayaModel
from laya.tokenizer import LayaTokenizer


def load_checkpoint(path: str) -> tuple[LayaModel, LayaTokenizer, LayaConfig]:
    """(model in fp32 eval mode on CPU, tokenizer, config) from an official-layout folder."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config, _, tokenizer, weights_path = read_parts(path)
    encoder_config = AutoConfig.from_pretrained(os.path.dirname(require(path, ENCODER_CONFIG)))
    model = LayaModel.from_encoder_config(encoder_config, config, init=False)
    weights = load_file(weights_path)
    check_weights(model, weights, weights_path)
    model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    return model.float().eval(), tokenizer, config


def check_weights(model: LayaModel, weights: dict[str, torch.Tensor], source: str) -> None:
    check_shapes({k: tuple(v.shape) for k, v in model.state_dict().items()},
                 {k: tuple(v.shape) for k, v in weights.items()}, source)


def save_checkpoint(path: str, model: LayaModel, tokenizer: LayaTokenizer, config: LayaConfig,
                    dtype: torch.dtype = torch.float16) -> None:
    """Write the layout `load_checkpoint` and the official runtime read (F16 weights by default, as released)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(path, WEIGHTS_FILE))
    _save_encoder_config(model.encoder.config, os.path.join(path, "encoder"))
    tokenizer.save(os.path.join(path, "tokenizer"))
    tmp = os.path.join(path, CONFIG_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(config.to_dict(), f, indent=2)
    os.replace(tmp, os.path.join(path, CONFIG_FILE))


def _save_encoder_config(encoder_config, folder: str) -> None:
    """transformers' `config.json`, less the `transformers_version` it stamps in: that key names the library
    that wrote the file, not the model, and would make a checkpoint rebuilt from the same seed differ byte
    for byte with every transformers release (the golden fixtures pin those bytes)."""
    encoder_config.save_pretrained(folder)
    target = os.path.join(folder, "config.json")
    with open(target, encoding="utf-8") as f:
        values = json.load(f)
    values.pop("transformers_version", None)
    tmp = target + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(values, indent=2, sort_keys=True) + "\n")    # transformers' own formatting
    os.replace(tmp, target)
