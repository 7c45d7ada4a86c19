"""Llama-family causal LM forward over a paged KV pool.

RMSNorm, rotary embeddings (default, linear or llama3 scaling), grouped-query attention and a
SwiGLU MLP, numerically following Hugging Face's `LlamaForCausalLM` so greedy outputs agree token
for token. The difference is where K/V live: every layer writes new K/V into pool slots and reads
a sequence's context back through its block table, so prefix reuse skips real compute.

One forward takes a flat batch of tokens: the first `n_decode` are one token per decoding sequence
(attended together in a single [B, 1] SDPA call over padded gathered context), the rest are prefill
chunks (attended per sequence). Projections and MLP run once over all tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


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
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
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
            attention_bias=cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            bos_token_id=cfg.get("bos_token_id"),
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


@dataclass
class AttentionBatch:
    """Where each token's K/V goes and which pool slots each query reads; built once per step."""

    positions: torch.Tensor  # [T]
    write_slots: torch.Tensor  # [T] flat pool slot per token
    n_decode: int
    # decode context = blocks every decode row shares (read once for the whole batch) + each row's own tail
    decode_shared: torch.Tensor | None = None  # [S] block ids common to all decode rows
    decode_slots: torch.Tensor | None = None  # [B, Lown] slots of each row's remaining context (padded)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, S*block_size + Lown] bool, True = attend
    # per prefill chunk: (first token, end token in the flat batch, context slots or None, mask or None)
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)
    logits_index: torch.Tensor | None = None  # [N] flat token rows that need logits


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

    def _decode_attention(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                          batch: AttentionBatch) -> torch.Tensor:
        """One token per row, cascade style: the shared prefix blocks are read once and multiplied
        against every row's queries as one GEMM; only each row's own tail is gathered per row.
        Query heads are grouped by their KV head, so grouped-query attention never copies K/V."""
        cfg = self.cfg
        B, KV, D = q.shape[0], cfg.num_key_value_heads, cfg.head_dim
        G = cfg.num_attention_heads // KV
        qg = q.view(B, KV, G, D)
        scale = D**-0.5
        own_k = k_pool.view(-1, KV, D)[batch.decode_slots].transpose(1, 2)  # [B, KV, Lown, D]
        own_v = v_pool.view(-1, KV, D)[batch.decode_slots].transpose(1, 2)
        shared = batch.decode_shared
        if shared is None:  # nothing shared (e.g. a single stream): one fused SDPA call
            return F.scaled_dot_product_attention(qg, own_k, own_v, attn_mask=batch.decode_mask).reshape(B, KV * G, D)
        sk = k_pool[shared].view(-1, KV, D).permute(1, 2, 0)  # [KV, D, Ls]
        sv = v_pool[shared].view(-1, KV, D).transpose(0, 1)  # [KV, Ls, D]
        rows = qg.permute(1, 0, 2, 3).reshape(KV, B * G, D)
        s_shared = torch.matmul(rows, sk).view(KV, B, G, -1).permute(1, 0, 2, 3)
        scores = torch.cat([s_shared, torch.matmul(qg, own_k.transpose(-1, -2))], dim=-1)  # [B, KV, G, Ls + Lown]
        scores = (scores.float() * scale).masked_fill(~batch.decode_mask, float("-inf"))
        probs = scores.softmax(-1).to(q.dtype)
        ls = sv.shape[1]
        out = torch.matmul(probs[..., ls:], own_v)
        p_shared = probs[..., :ls].permute(1, 0, 2, 3).reshape(KV, B * G, ls)
        out = out + torch.matmul(p_shared, sv).view(KV, B, G, D).permute(1, 0, 2, 3)
        return out.reshape(B, KV * G, D)

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits for `batch.logits_index` rows; K/V of every input token is written into `kv` (per-layer pools)."""
        cfg = self.cfg
        T = input_ids.shape[0]
        H, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self._ensure_rope(int(batch.positions.max()) + 1)
        cos = self.cos[batch.positions][:, None, :]
        sin = self.sin[batch.positions][:, None, :]
        nd = batch.n_decode
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
            k_flat = k_pool.view(-1, KV, D)
            v_flat = v_pool.view(-1, KV, D)
            k_flat.index_copy_(0, batch.write_slots, k)
            v_flat.index_copy_(0, batch.write_slots, v)
            out = torch.empty_like(q)
            if nd:
                out[:nd] = self._decode_attention(q[:nd], k_pool, v_pool, batch)
            for start, end, slots, mask in batch.prefills:
                qs = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
                if slots is None:  # the chunk is the whole context: attend to it directly
                    ck, cv = k[start:end], v[start:end]
                    o = F.scaled_dot_product_attention(
                        qs, ck.transpose(0, 1).unsqueeze(0), cv.transpose(0, 1).unsqueeze(0), is_causal=True, enable_gqa=True
                    )
                else:
                    ck = k_flat[slots].transpose(0, 1).unsqueeze(0)
                    cv = v_flat[slots].transpose(0, 1).unsqueeze(0)
                    o = F.scaled_dot_product_attention(qs, ck, cv, attn_mask=mask, enable_gqa=True)
                out[start:end] = o.squeeze(0).transpose(0, 1)
            h = h + F.linear(out.view(T, H * D), layer["o"], layer["o_b"])
            x = rms_norm(h, layer["post_norm"], cfg.rms_norm_eps)
            gate, up = F.linear(x, layer["gate_up"], layer["gate_up_b"]).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer["down"], layer["down_b"])
        if batch.logits_index is not None:
            h = h[batch.logits_index]
        h = rms_norm(h, self.norm, cfg.rms_norm_eps)
        return F.linear(h, self.lm_head)
