"""Owns the model and the KV pool tensors; turns a StepPlan into one forward.

Index tensors (write slots, padded context slots, masks) are built once per step from block tables
with vectorised tensor ops, so a layer's attention is a gather plus SDPA, with no Python per token.
"""

from __future__ import annotations

import torch

from generation.config import EngineConfig
from generation.modeling_llama import AttentionBatch, LlamaConfig, LlamaModel
from generation.scheduler import StepPlan
from generation.sequence import Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.model = LlamaModel(model_cfg, weights, self.device, self.dtype)
        self.block_size = cfg.block_size
        kvh, hd, layers = model_cfg.num_key_value_heads, model_cfg.head_dim, model_cfg.num_hidden_layers
        per_block = 2 * layers * cfg.block_size * kvh * hd * torch.empty((), dtype=self.dtype).element_size()
        self.num_blocks = cfg.num_blocks or max(2, cfg.kv_cache_memory_mb * 2**20 // per_block)
        shape = (self.num_blocks, cfg.block_size, kvh, hd)
        self.kv = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(layers)
        ]
        self.forwards = 0

    def _tables(self, seqs: list[Sequence], width: int) -> torch.Tensor:
        rows = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    def _slots(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat pool slot of each position, given a sequence's (or batch's) block table rows."""
        bs = self.block_size
        return table.gather(-1, positions // bs) * bs + positions % bs

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor, list[Sequence]]:
        """Forward the plan; returns logits for the sequences that now need a next token, in order."""
        for src, dst in plan.copies:
            for k, v in self.kv:
                k[dst].copy_(k[src])
                v[dst].copy_(v[src])
        dev = self.device
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq in plan.decode:
            ids.append(seq.all_ids[seq.num_computed])
            positions.append(seq.num_computed)
            if not seq.prefill_only:
                logit_rows.append(len(ids) - 1)
                sampled.append(seq)
        for seq, n in plan.prefill:
            start = seq.num_computed
            ids.extend(seq.all_ids[start : start + n])
            positions.extend(range(start, start + n))
            if start + n == len(seq) and not seq.prefill_only:
                logit_rows.append(len(ids) - 1)
                sampled.append(seq)
        pos_t = torch.tensor(positions, dtype=torch.long, device=dev)
        seqs = plan.decode + [s for s, _ in plan.prefill]
        width = max(len(s.block_table) for s in seqs)
        tables = self._tables(seqs, width)
        nd = len(plan.decode)
        counts = [1] * nd + [n for _, n in plan.prefill]
        row_of_token = torch.repeat_interleave(torch.arange(len(seqs), device=dev), torch.tensor(counts, device=dev))
        write_slots = self._slots(tables[row_of_token], pos_t[:, None]).squeeze(1)
        batch = AttentionBatch(positions=pos_t, write_slots=write_slots, n_decode=nd)
        if nd:
            bs = self.block_size
            # leading blocks identical in every decode row (all full: a row only writes past them)
            common = 0
            if nd > 1:  # a single row shares with nobody: plain attention over its context
                same = (tables[:nd] == tables[:1]).all(0).long().cumprod(0)
                common = min(int(same.sum()), min(p // bs for p in positions[:nd]))
            ctx = pos_t[:nd] + 1
            span = torch.arange(common * bs, int(ctx.max()), device=dev)
            batch.decode_slots = self._slots(tables[:nd], span.expand(nd, span.numel()))
            if common:
                batch.decode_shared = tables[0, :common]
                span = torch.arange(int(ctx.max()), device=dev)
            if common or int(ctx.min()) != int(ctx.max()):
                batch.decode_mask = (span[None, :] < ctx[:, None])[:, None, None, :]
        offset = nd
        for i, (seq, n) in enumerate(plan.prefill):
            start = seq.num_computed
            if start == 0:
                batch.prefills.append((offset, offset + n, None, None))
            else:
                span = torch.arange(start + n, device=dev)
                slots = self._slots(tables[nd + i], span)
                q_pos = torch.arange(start, start + n, device=dev)
                batch.prefills.append((offset, offset + n, slots, span[None, :] <= q_pos[:, None]))
            offset += n
        batch.logits_index = torch.tensor(logit_rows, dtype=torch.long, device=dev)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        logits = self.model.forward(input_ids, batch, self.kv)
        self.forwards += 1
        return logits, sampled
