"""Training the encoder student: KL to the teacher's calibrated distributions, one pass per state.

Every question's head reads the same pooled state, so one encoder forward answers all of them; the
loss is the sum over questions of KL(teacher || student), plus, for `score` questions, the squared
gap between expected levels (normalised by the scale length), because a score is reported as an
expectation and a student can match the argmax while drifting on the mean.
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from distill.fidelity import mean_kl
from distill.modeling_student import EncoderStudent, from_minilm, pad
from distill.task import Task
from laya.calibration import softmax
from laya.training.trainer import plan_batches


def distill_loss(logits: torch.Tensor, heads: list[dict], scores: set[str], targets: dict[str, torch.Tensor],
                 score_weight: float, question_weights: dict[str, float] | None = None) -> torch.Tensor:
    """Σ KL(teacher ‖ student) over heads, plus the expected-level gap for the questions in `scores`, each
    question's part times its `question_weights` entry (1 if absent)."""
    loss = logits.new_zeros(())
    for h in heads:
        z = logits[:, h["offset"]:h["offset"] + h["size"]]
        t = targets[h["name"]]
        logp = F.log_softmax(z, -1)
        part = F.kl_div(logp, t, reduction="batchmean")
        if h["name"] in scores:
            levels = torch.arange(h["size"], dtype=z.dtype)
            gap = ((logp.exp() - t) * levels).sum(-1) / (h["size"] - 1)
            part = part + score_weight * (gap ** 2).mean()
        loss = loss + (question_weights or {}).get(h["name"], 1.0) * part
    return loss


def sharpen(targets: dict[str, np.ndarray], temperature: float) -> dict[str, np.ndarray]:
    """softmax(log p / T) per row: the distributions a student trains on when `student.target_temperature` < 1
    puts more of each row's weight on the teacher's answer than the teacher's calibrated confidence does."""
    if temperature == 1.0:
        return targets
    return {k: softmax(np.log(np.clip(np.asarray(p, dtype=np.float64), 1e-12, 1.0)), temperature).astype(p.dtype)
            for k, p in targets.items()}


@torch.no_grad()
def predict_logits(model: EncoderStudent, ids: list[list[int]], batch_size: int = 64) -> np.ndarray:
    model.eval()
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = np.zeros((len(ids), sum(h.out_features for h in model.heads)), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        x, m = pad([ids[i] for i in chunk])
        out[chunk] = model(x, m).numpy()
    return out


def train_encoder(task: Task, train_ids: list[list[int]], train_t: dict[str, np.ndarray], val_ids: list[list[int]],
                  val_t: dict[str, np.ndarray], progress: bool = True,
                  teacher: Path | None = None) -> tuple[EncoderStudent, list[dict]]:
    """Returns the student with the lowest validation KL over epochs (to the targets it trains on, sharpened by
    `student.target_temperature`), and the per-epoch history.

    `teacher` is the teacher's checkpoint folder, read when `student.init` is `teacher`."""
    from tqdm.auto import tqdm

    s = task.student
    torch.set_num_threads(s.threads or os.cpu_count() or 1)
    heads = task.heads()
    scores = {name for name, q in task.parsed.items() if q.type == "score"}
    model = from_minilm(s.layers, [h["size"] for h in heads], seed=s.seed,
                        teacher=teacher if s.init == "teacher" else None, pick=s.init_layers)
    if s.freeze_embeddings:  # the vocabulary table is most of the weights and gains little from a few thousand rows
        model.word.weight.requires_grad_(False)
    head_params = list(model.heads.parameters())
    body = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("heads.")]
    opt = torch.optim.AdamW([{"params": body, "lr": s.lr}, {"params": head_params, "lr": s.head_lr}],
                            weight_decay=0.01)
    rng = random.Random(s.seed)
    lengths = [len(r) for r in train_ids]
    steps = s.epochs * -(-len(train_ids) // s.batch_size)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * max(0.05, 1.0 - i / steps))
    train_t, val_t = sharpen(train_t, s.target_temperature), sharpen(val_t, s.target_temperature)
    tt = {k: torch.tensor(v, dtype=torch.float32) for k, v in train_t.items()}
    best, best_kl, history = None, float("inf"), []
    with tqdm(total=steps, desc=f"train {s.layers}-layer student", unit="step", disable=not progress) as bar:
        for epoch in range(s.epochs):
            model.train()
            for batch in plan_batches(lengths, s.batch_size, rng, window_batches=32):
                x, m = pad([train_ids[i] for i in batch])
                loss = distill_loss(model(x, m), heads, scores, {k: v[batch] for k, v in tt.items()},
                                    s.score_weight, s.question_weights)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.4f}")
            logits = predict_logits(model, val_ids).astype(np.float64)
            kl = sum(mean_kl(val_t[h["name"]], softmax(logits[:, h["offset"]:h["offset"] + h["size"]]))
                     for h in heads)
            history.append({"epoch": epoch + 1, "val_kl": round(kl, 5)})
            bar.write(f"epoch {epoch + 1}: validation KL (sum over questions) {kl:.4f}")
            if not np.isfinite(kl):  # NaN never beats the best, and every later epoch would be NaN too
                raise ValueError(f"student training diverged: validation KL is {kl} at epoch {epoch + 1}; lower "
                                 f"student.lr ({s.lr:g}) or student.head_lr ({s.head_lr:g})")
            if kl < best_kl:
                best, best_kl = copy.deepcopy(model.state_dict()), kl
    model.load_state_dict(best)
    model.eval()
    return model, history
