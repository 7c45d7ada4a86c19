"""Attention over the paged KV pool, for any decoder architecture.

A model file projects a flat batch of tokens to q, k, v (after its own position encoding) and calls
`PagedAttention`; this module alone knows how K/V are laid out (per layer `[num_blocks, block_size,
kv_heads, head_dim]`, addressed through block tables) and how each kind of query reads them:

- **Decode rows** (one new token per sequence) are attended together, cascade style: the leading blocks
  every row shares (a system prompt, a pin) are read once and multiplied against all rows' queries as one
  GEMM; only each row's own tail is gathered per row; both score sets share one softmax, so the result is
  exact attention. Query heads are grouped by KV head, so grouped-query attention never copies K/V. With
  nothing shared (a single stream), it is one SDPA call over the gathered context.
- **Prefill chunks** attend per sequence with SDPA; a chunk that is its sequence's whole context attends
  to its own fresh K/V with `is_causal`, others gather their context from the pool.

`AttentionBatch.build` turns block tables into flat slot indices and masks once per step, with tensor ops
(no Python per token), so every layer reuses them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def pool_slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat pool slot of each position, given a sequence's (or batch's) block table rows."""
    return tables.gather(-1, positions // block_size) * block_size + positions % block_size


@dataclass
class AttentionBatch:
    """Where each token's K/V goes and which pool slots each query reads; built once per step."""

    positions: torch.Tensor  # [T] position of every token (the model's position encoding reads it too)
    write_slots: torch.Tensor  # [T] flat pool slot per token
    n_decode: int
    # decode context = blocks every decode row shares (read once for the whole batch) + each row's own tail
    decode_shared: torch.Tensor | None = None  # [S] block ids common to all decode rows
    decode_slots: torch.Tensor | None = None  # [B, Lown] slots of each row's remaining context (padded)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, S*block_size + Lown] bool, True = attend
    # per prefill chunk: (first token, end token in the flat batch, context slots or None, mask or None)
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]] = field(default_factory=list)

    @classmethod
    def build(cls, tables: torch.Tensor, positions: list[int], n_decode: int, prefill: list[tuple[int, int]],
              block_size: int) -> AttentionBatch:
        """`tables` has one padded block-table row per sequence: the `n_decode` decoding ones first, then one
        per prefill chunk, given as (first position, token count). `positions` lists every token's position
        in that order (one per decode row, then each chunk's)."""
        dev = tables.device
        bs = block_size
        nd = n_decode
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        counts = [1] * nd + [n for _, n in prefill]
        row_of_token = torch.repeat_interleave(torch.arange(len(counts), device=dev), torch.tensor(counts, device=dev))
        write_slots = pool_slots(tables[row_of_token], pos_t[:, None], bs).squeeze(1)
        batch = cls(positions=pos_t, write_slots=write_slots, n_decode=nd)
        if nd:
            # leading blocks identical in every decode row (all full: a row only writes past them)
            common = 0
            if nd > 1:  # a single row shares with nobody: plain attention over its context
                same = (tables[:nd] == tables[:1]).all(0).long().cumprod(0)
                common = min(int(same.sum()), min(p // bs for p in positions[:nd]))
            ctx = pos_t[:nd] + 1
            span = torch.arange(common * bs, int(ctx.max()), device=dev)
            batch.decode_slots = pool_slots(tables[:nd], span.expand(nd, span.numel()), bs)
            if common:
                batch.decode_shared = tables[0, :common]
                span = torch.arange(int(ctx.max()), device=dev)
            if common or int(ctx.min()) != int(ctx.max()):
                batch.decode_mask = (span[None, :] < ctx[:, None])[:, None, None, :]
        offset = nd
        for i, (start, n) in enumerate(prefill):
            if start == 0:
                batch.prefills.append((offset, offset + n, None, None))
            else:
                span = torch.arange(start + n, device=dev)
                slots = pool_slots(tables[nd + i], span, bs)
                q_pos = torch.arange(start, start + n, device=dev)
                batch.prefills.append((offset, offset + n, slots, span[None, :] <= q_pos[:, None]))
            offset += n
        return batch


class PagedAttention:
    """One layer's attention: writes the batch's new K/V into the pool, then attends every query."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor,
                 v_pool: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """q [T, H, D], k/v [T, KV, D] -> attention output [T, H, D]; K/V are stored at `batch.write_slots`."""
        KV, D = self.num_kv_heads, self.head_dim
        k_flat = k_pool.view(-1, KV, D)
        v_flat = v_pool.view(-1, KV, D)
        k_flat.index_copy_(0, batch.write_slots, k)
        v_flat.index_copy_(0, batch.write_slots, v)
        out = torch.empty_like(q)
        nd = batch.n_decode
        if nd:
            out[:nd] = self._decode(q[:nd], k_pool, v_pool, batch)
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
        return out

    def _decode(self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: AttentionBatch) -> torch.Tensor:
        """Cascade decode attention (see the module docstring): shared blocks once, each row's tail per row."""
        B, KV, D = q.shape[0], self.num_kv_heads, self.head_dim
        G = self.num_heads // KV
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
