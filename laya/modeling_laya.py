"""The Laya decision model: a bidirectional encoder plus a typed head that scores one [MASK] per option.

Parameter names match the released checkpoints (`encoder.*`, `head.layers.{i}.*`, `type_emb`,
`scorer.{0,1,3}`, `act_head.{0,2}`, buffer `temperature`), so `load_state_dict` takes them as-is.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

from laya.config import LayaConfig
from laya.engine import ACT_HIDDEN, HEAD_DIM, MAX_OPTIONS_FEATURE

UNUSED_SLOT_LOGIT = -1e4
MAX_SLOTS = 256            # >= the 255 options a question may have: the fixed width of the inference tail
TAIL_ROWS = 64             # the inference tail's matmuls always see this many rows (padded)


class LayaHead(nn.Module):
    """Post-encoder transformer layers; a plain container so weights are named `head.layers.{i}`."""

    def __init__(self, d: int, n_layers: int, dropout: float):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, max(1, d // HEAD_DIM), 4 * d, dropout, activation="relu",
                                       batch_first=True, norm_first=True)
            for _ in range(n_layers))

    def forward(self, h: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(h, src_key_padding_mask=pad)
        return h


class LayaModel(nn.Module):
    def __init__(self, encoder: nn.Module, head_layers: int = 2, n_act: int = 2, dropout: float = 0.1):
        super().__init__()
        self.encoder = encoder
        d = encoder.config.hidden_size
        self.head = LayaHead(d, head_layers, dropout) if head_layers > 0 else None
        self.type_emb = nn.Embedding(3, d)
        self.scorer = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, d), nn.GELU(), nn.Linear(d, 1))
        self.act_head = nn.Sequential(nn.Linear(d + 4, ACT_HIDDEN), nn.GELU(), nn.Linear(ACT_HIDDEN, n_act))
        # Shipped for provenance; inference reads temperatures from rl_agent_config.json (see laya.calibration).
        self.register_buffer("temperature", torch.ones(3))

    @classmethod
    def from_encoder_config(cls, encoder_config, config: LayaConfig, init: bool = True) -> LayaModel:
        """Model with a randomly initialised encoder of `encoder_config` (init=False: weights to be loaded)."""
        from transformers import AutoModel

        if hasattr(encoder_config, "reference_compile"):
            encoder_config.reference_compile = False
        with nullcontext() if init else _no_init_weights():
            encoder = AutoModel.from_config(encoder_config, attn_implementation="sdpa")
            return cls(encoder, config.head_layers, config.n_act)

    @classmethod
    def from_pretrained_encoder(cls, encoder_dir: str, config: LayaConfig) -> LayaModel:
        """Pretrained encoder weights from a transformers folder, freshly initialised head (for training)."""
        from transformers import AutoModel

        encoder = AutoModel.from_pretrained(encoder_dir, attn_implementation="sdpa")
        if hasattr(encoder.config, "reference_compile"):
            encoder.config.reference_compile = False
        return cls(encoder, config.head_layers, config.n_act)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, marker_pos: torch.Tensor,
                marker_mask: torch.Tensor, qtype: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [B, K] with -1e4 at unused slots, act_logits [B, n_act]); differentiable."""
        return self.score(self.hidden(input_ids, attention_mask, qtype), marker_pos, marker_mask)

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, qtype: torch.Tensor) -> torch.Tensor:
        """Head output at every position [B, L, d]: encoder + type embedding + head layers."""
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        h = h + self.type_emb(qtype)[:, None, :]
        if self.head is not None:
            h = self.head(h, ~attention_mask.bool())
        return h

    def score(self, h: torch.Tensor, marker_pos: torch.Tensor,
              marker_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Option logits at the marker positions and the act head's logits, from head output `h`."""
        idx = marker_pos.clamp(min=0)[:, :, None].expand(-1, -1, h.size(-1))
        return self.decide(torch.gather(h, 1, idx), h[:, 0], marker_mask)

    def decide(self, at_markers: torch.Tensor, at_cls: torch.Tensor,
               marker_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output layers: scorer over the marker states [B, K, d], act head over [CLS] [B, d]."""
        logits = self.scorer(at_markers).squeeze(-1).float()
        logits = logits.masked_fill(~marker_mask, UNUSED_SLOT_LOGIT)
        return logits, self.act_head(torch.cat([at_cls.float(), act_features(logits, marker_mask)], -1))

    def infer(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, qtype: torch.Tensor,
              marker_pos: torch.Tensor, n_markers: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Inference: per row (logits [k], act_logits [n_act]), equal to `forward` up to float rounding.

        The last head layer is read only at [CLS] and the markers, so only its keys and values are
        computed at every position; its queries, output projection and feed-forward run for those
        1 + k positions alone (~5% of the FLOPs of a ModernBERT-base checkpoint, ~12% of a MiniLM one).
        What follows the batched encoder must not let a row's bits depend on its batch mates, yet should
        batch: the selected positions of all rows go through the small matmuls together, in chunks
        padded to exactly TAIL_ROWS rows (a BLAS picks its kernel by shape, so the shape never changes),
        the option softmax runs over a fixed MAX_SLOTS width, and attention runs per row over its own keys.
        """
        pad = ~attention_mask.bool()
        h = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        h = h + self.type_emb(qtype)[:, None, :]
        layers = list(self.head.layers) if self.head is not None else []
        for layer in layers[:-1]:
            h = layer(h, src_key_padding_mask=pad)
        counts = torch.tensor([1 + k for k in n_markers], device=h.device)
        rows = torch.arange(len(n_markers), device=h.device).repeat_interleave(counts)
        cols = torch.cat([torch.cat([marker_pos.new_zeros(1), marker_pos[j, :k]])
                          for j, k in enumerate(n_markers)])
        picked = h[rows, cols]
        if layers:
            last = layers[-1]
            attn = last.self_attn
            x = last.norm1(h)
            w_q, w_k, w_v = attn.in_proj_weight.chunk(3)
            b_q, b_k, b_v = attn.in_proj_bias.chunk(3)
            keys = F.linear(x, w_k, b_k).unflatten(-1, (attn.num_heads, -1)).transpose(1, 2)
            values = F.linear(x, w_v, b_v).unflatten(-1, (attn.num_heads, -1)).transpose(1, 2)
            q = _fixed_rows(lambda t: F.linear(t, w_q, b_q), x[rows, cols]).unflatten(-1, (attn.num_heads, -1))
            parts, start = [], 0
            for j, k in enumerate(n_markers):
                qj = q[start:start + 1 + k].transpose(0, 1)
                a = F.scaled_dot_product_attention(qj, keys[j], values[j], attn_mask=~pad[j][None, None, :])
                parts.append(a.transpose(0, 1).flatten(-2))
                start += 1 + k
            picked = picked + _fixed_rows(attn.out_proj, torch.cat(parts))
            picked = picked + _fixed_rows(lambda t: last.linear2(last.activation(last.linear1(last.norm2(t)))), picked)
        is_cls = torch.zeros(len(rows), dtype=torch.bool, device=h.device)
        is_cls[torch.cumsum(counts, 0) - counts] = True
        scores = _fixed_rows(self.scorer, picked[~is_cls]).squeeze(-1).float()
        slots = torch.full((len(n_markers), MAX_SLOTS), UNUSED_SLOT_LOGIT, device=h.device)
        mask = torch.zeros((len(n_markers), MAX_SLOTS), dtype=torch.bool, device=h.device)
        start = 0
        for j, k in enumerate(n_markers):
            slots[j, :k] = scores[start:start + k]
            mask[j, :k] = True
            start += k
        features = _fixed_rows(lambda t: act_features(t[:, :MAX_SLOTS], t[:, MAX_SLOTS:].bool()),
                               torch.cat([slots, mask.float()], -1))
        act = _fixed_rows(self.act_head, torch.cat([picked[is_cls].float(), features], -1))
        return [(slots[j, :k], act[j]) for j, k in enumerate(n_markers)]


def _fixed_rows(fn, x: torch.Tensor) -> torch.Tensor:
    """fn over the rows of x in chunks of exactly TAIL_ROWS rows (zero-padded), so every call has one shape."""
    out = []
    for start in range(0, x.size(0), TAIL_ROWS):
        chunk = x[start:start + TAIL_ROWS]
        n = chunk.size(0)
        if n < TAIL_ROWS:
            chunk = torch.cat([chunk, chunk.new_zeros((TAIL_ROWS - n, *chunk.shape[1:]))])
        out.append(fn(chunk)[:n])
    return torch.cat(out)


def act_features(logits: torch.Tensor, marker_mask: torch.Tensor) -> torch.Tensor:
    """[top1, top1 - top2, entropy / ln k, k / 255] of the untempered option distribution (no gradient)."""
    p = torch.softmax(logits.detach(), -1)
    k = marker_mask.sum(-1).clamp(min=2).float()
    entropy = -(p * torch.log(p.clamp_min(1e-9))).sum(-1) / torch.log(k)
    if p.size(-1) >= 2:
        top = p.topk(2, -1).values
    else:  # one slot: softmax is exactly 1, so the gap to a missing second option is 1
        top = torch.cat([p, torch.zeros_like(p)], -1)
    return torch.stack([top[:, 0], top[:, 0] - top[:, 1], entropy, k / MAX_OPTIONS_FEATURE], -1)


def _no_init_weights():
    """Skip parameter init when every weight is about to be overwritten by a checkpoint."""
    from transformers.initialization import no_init_weights

    return no_init_weights()

