"""Owns the model and the KV pool tensors; turns a StepPlan into one forward.

The runner flattens the plan into token ids and positions, applies the plan's copy-on-write block copies,
and lets `AttentionBatch.build` derive every layer's slot indices from the block tables once per step.
Logits are computed only for rows someone reads: the last token of each sequence that samples, and the
prompt positions whose log-probabilities a request asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from generation.attention import AttentionBatch
from generation.config import EngineConfig
from generation.modeling_llama import LlamaConfig, LlamaModel
from generation.scheduler import StepPlan
from generation.sequence import Sequence

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class StepLogits:
    """The forward's logits: first one row per sequence in `sampled`, then the prompt-scoring rows."""

    logits: torch.Tensor
    sampled: list[Sequence]
    prompt_rows: list[tuple[Sequence, int, int]]  # (sequence, first position, number of consecutive rows)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: LlamaConfig, weights: dict[str, torch.Tensor]) -> None:
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.model = LlamaModel(model_cfg, weights, self.device, self.dtype)
        self.block_size = cfg.block_size
        kvh, hd, layers = model_cfg.num_key_value_heads, model_cfg.head_dim, model_cfg.num_hidden_layers
        per_block = 2 * layers * cfg.block_size * kvh * hd * torch.empty((), dtype=self.dtype).element_size()
        self.block_bytes = per_block  # one block's keys and values over every layer
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

    @torch.inference_mode()
    def run(self, plan: StepPlan) -> StepLogits:
        """Forward the plan; logits for the sequences that now need a next token, then for prompt scoring."""
        for src, dst in plan.copies:
            for k, v in self.kv:
                k[dst].copy_(k[src])
                v[dst].copy_(v[src])
        ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        prompt_index: list[int] = []
        prompt_rows: list[tuple[Sequence, int, int]] = []
        for seq in plan.decode:
            ids.append(seq.all_ids[seq.num_computed])
            positions.append(seq.num_computed)
            if not seq.prefill_only:
                logit_rows.append(len(ids) - 1)
                sampled.append(seq)
        for seq, n in plan.prefill:
            start, base = seq.num_computed, len(ids)
            ids.extend(seq.all_ids[start : start + n])
            positions.extend(range(start, start + n))
            if start + n == len(seq) and not seq.prefill_only:
                logit_rows.append(len(ids) - 1)
                sampled.append(seq)
            first = seq.prompt_logits_from
            if first is not None:  # positions up to the prompt's second-to-last token score the next one
                lo, hi = max(start, first), min(start + n, len(seq.prompt_ids) - 1)
                if lo < hi:
                    prompt_index.extend(range(base + lo - start, base + hi - start))
                    prompt_rows.append((seq, lo, hi - lo))
        seqs = plan.decode + [s for s, _ in plan.prefill]
        tables = self._tables(seqs, max(len(s.block_table) for s in seqs))
        spans = [(seq.num_computed, n) for seq, n in plan.prefill]
        batch = AttentionBatch.build(tables, positions, len(plan.decode), spans, self.block_size)
        index = torch.tensor(logit_rows + prompt_index, dtype=torch.long, device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        logits = self.model.forward(input_ids, batch, self.kv, index)
        self.forwards += 1
        return StepLogits(logits, sampled, prompt_rows)
