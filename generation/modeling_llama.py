"""Llama-family causal LM forward over a paged KV pool.

RMSNorm, rotary embeddings (default, linear or llama3 scaling), grouped-query attention and a
SwiGLU MLP, numerically following Hugging Face's `LlamaForCausalLM` so greedy outputs agree token
for token. This file holds only the architecture: where K/V live and how queries read them (the
paged pool, cascade decode attention) is `generation.attention`, which any decoder can call.

One forward takes a flat batch of tokens (one per decoding sequence, then prefill chunks);
projections and MLP run once over all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from generation.attention import AttentionBatch, PagedAttention


@dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Read a Hugging Face `config.json` (transformers 4 `rope_theta`/`rope_scaling` or 5 `rope_parameters`)."""
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        eos = cfg.get("eos_token_id")
        eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else rope,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=list(eos_ids),
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        blend = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - blend) * scaled / factor + blend * scaled
        middle = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(middle, smoothed, scaled)
    raise ValueError(f"config.rope_scaling.rope_type: {kind!r} is not supported (default, linear, llama3)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    """Weights as plain tensors (q/k/v and gate/up fused) and a forward that reads/writes the KV pool."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype):
        self.cfg = cfg
        self.device = device
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_word_embeddings or "lm_head.weight" not in weights else w("lm_head.weight")
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv_b = [opt(a + f"{n}_proj.bias") for n in "qkv"]
            gu_b = [opt(m + f"{n}_proj.bias") for n in ("gate", "up")]
            self.layers.append(
                {
                    "in_norm": w(p + "input_layernorm.weight"),
                    "post_norm": w(p + "post_attention_layernorm.weight"),
                    "qkv": torch.cat([w(a + f"{n}_proj.weight") for n in "qkv"]),
                    "qkv_b": torch.cat(qkv_b) if all(b is not None for b in qkv_b) else None,
                    "o": w(a + "o_proj.weight"),
                    "o_b": opt(a + "o_proj.bias"),
                    "gate_up": torch.cat([w(m + "gate_proj.weight"), w(m + "up_proj.weight")]),
                    "gate_up_b": torch.cat(gu_b) if all(b is not None for b in gu_b) else None,
                    "down": w(m + "down_proj.weight"),
                    "down_b": opt(m + "down_proj.bias"),
                }
            )
        self.attention = PagedAttention(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        inv_freq = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.to(device)
        self._rope_len = 0
        self._ensure_rope(max(cfg.max_position_embeddings, 1))

    def _ensure_rope(self, length: int) -> None:
        if length <= self._rope_len:
            return
        pos = torch.arange(length, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(self.dtype)
        self.sin = emb.sin().to(self.dtype)
        self._rope_len = length

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: list[tuple[torch.Tensor, torch.Tensor]],
                logits_index: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for the `logits_index` rows (all rows if None); every token's K/V is written into `kv`."""
        cfg = self.cfg
        T = input_ids.shape[0]
        H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self._ensure_rope(int(batch.positions.max()) + 1)
        cos = self.cos[batch.positions][:, None, :]
        sin = self.sin[batch.positions][:, None, :]
        h = self.embed[input_ids]
        for layer, (k_pool, v_pool) in zip(self.layers, kv):
            x = rms_norm(h, layer["in_norm"], cfg.rms_norm_eps)
            qkv = F.linear(x, layer["qkv"], layer["qkv_b"])
            q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
            q = q.view(T, H, D)
            k = k.view(T, KV, D)
            v = v.view(T, KV, D)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            out = self.attention(q, k, v, k_pool, v_pool, batch)
            h = h + F.linear(out.view(T, H * D), layer["o"], layer["o_b"])
            x = rms_norm(h, layer["post_norm"], cfg.rms_norm_eps)
            gate, up = F.linear(x, layer["gate_up"], layer["gate_up_b"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["down"], layer["down_b"])
        if logits_index is not None:
            h = h[logits_index]
        h = rms_norm(h, self.norm, cfg.rms_norm_eps)
        return F.linear(h, self.lm_head)
