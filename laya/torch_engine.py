"""Inference on the torch module `LayaModel`: GPUs, and encoders the packed CPU paths do not build.

Rows are padded to a multiple of PAD_MULTIPLE of their own length and only rows of equal padded
length share a tensor, so a row is always computed at the same length. The batch dimension is the
one thing batch mates change: on CPU in fp32 MKL's per-row results do not depend on it (the tests
check it); where that is not known (GPU kernels, oneDNN's bf16 kernels) every forward gets the same
number of rows, padded, so the kernels never see another shape. The tail after the encoder is
`LayaModel.infer`'s, batched over a fixed row count.

bf16: Linear weights are stored in bf16 and the forward runs under bf16 autocast (LayerNorm and the
softmaxes stay fp32). On CPU that is the fallback for encoders `laya.packed_engine` does not build
(ModernBERT and BERT run there, 1.7x as fast at base size).
"""

from __future__ import annotations

import time

import torch

from laya.batching import collate
from laya.engine import RowOutput
from laya.modeling_laya import LayaModel
from laya.precision import Plan
from laya.rows import Row

PAD_MULTIPLE = 16
MAX_BATCH_TOKENS = 16384
FIXED_ROWS = {"cuda": 8, "cpu": 1}   # rows per forward where shapes must be fixed (GPU, bf16 on CPU)


class TorchEngine:
    def __init__(self, model: LayaModel, pad_id: int, plan: Plan, threads: int | None = None):
        started = time.perf_counter()
        self.plan = plan
        self.device = torch.device(plan.device)
        self.model = model.to(self.device).eval()
        self.pad_id = pad_id
        if threads:
            torch.set_num_threads(threads)
        self.bf16 = plan.precision == "bf16"
        if self.bf16:
            for m in self.model.modules():
                if isinstance(m, torch.nn.Linear):
                    m.to(torch.bfloat16)
        fixed = self.bf16 or self.device.type != "cpu"
        self.fixed_rows = FIXED_ROWS.get(self.device.type, FIXED_ROWS["cuda"]) if fixed else None
        self.load_s = time.perf_counter() - started

    @classmethod
    def load(cls, path: str, plan: Plan, threads: int | None = None) -> TorchEngine:
        from laya.checkpoint import load_checkpoint

        model, tokenizer, _ = load_checkpoint(path)
        return cls(model, tokenizer.pad_token_id, plan, threads)

    def describe(self) -> dict:
        return {**self.plan.summary(), "threads": torch.get_num_threads(), "load_s": round(self.load_s, 2),
                "rows_per_forward": self.fixed_rows or "by length"}

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> list[RowOutput]:
        out: list[RowOutput | None] = [None] * len(rows)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(-(-r.n_tokens // PAD_MULTIPLE) * PAD_MULTIPLE, []).append(i)
        for length, members in sorted(groups.items()):
            step = self.fixed_rows or max(1, MAX_BATCH_TOKENS // length)
            for start in range(0, len(members), step):
                chunk = members[start:start + step]
                batch_rows = [rows[i] for i in chunk]
                if self.fixed_rows:   # pad with copies of the first row: same shape every call
                    batch_rows += [batch_rows[0]] * (step - len(batch_rows))
                batch = collate(batch_rows, self.pad_id, length)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
                    per_row = self.model.infer(batch["input_ids"], batch["attention_mask"], batch["qtype"],
                                               batch["marker_pos"], [len(r.markers) for r in batch_rows])
                for i, (logits, act) in zip(chunk, per_row):
                    out[i] = RowOutput(logits.float().cpu().numpy(), torch.softmax(act.float(), -1).cpu().numpy())
        return out  # type: ignore[return-value]
