"""Tiny random checkpoints in the official layout: the fixtures of everyone's tests.

Everything is a function of the builder arguments: the BPE tokenizer is trained on a fixed corpus
and every tensor is drawn from a `torch.Generator` seeded per tensor name, so the same arguments
rebuild the same bytes (the golden fixtures rely on it). Weights are scaled so that option logits
differ by whole units: with the usual 0.02 init every answer would be a uniform distribution and
a golden comparison would prove nothing.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from laya.checkpoint import save_checkpoint
from laya.config import LayaConfig
from laya.modeling_laya import LayaModel
from laya.paths import minilm_dir
from laya.tokenizer import LayaTokenizer

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CORPUS = [
    "Hi, we were billed twice for March. Please refund the duplicate today or we will cancel our plan.",
    "choice question: Which department should handle this? score question: How urgent is it?",
    "noul question: Does the user threaten to cancel or leave? yes, the statement holds. no, the statement does not hold.",
    "billing: invoices, payments, refunds. technical: bugs, outages, system errors. other: everything else.",
    "level 0: not urgent. level 1: soon. level 2: blocking. true false label description criteria",
    "The server is down again and our team cannot log in. Please fix the outage as soon as possible.",
    "Thanks for the quick answer, everything works now. Have a nice weekend!",
    "user: hello assistant: how can I help you today? user: my invoice is wrong, I was charged twice.",
    "Der Kunde möchte sein Abonnement kündigen. Le client veut annuler. ¿Puedo cambiar mi plan?",
    "{\"customer\": \"ACME\", \"plan\": \"pro\", \"tickets\": [1, 2, 3], \"sentiment\": \"angry\"}",
    "red green blue yellow cat dog bird fish one two three four five six seven eight nine ten eleven twelve",
    "sentiment positive negative neutral spam ham priority low medium high critical escalate ask answer",
]


def train_tokenizer(vocab_size: int = 512) -> LayaTokenizer:
    """A byte-level BPE tokenizer (ModernBERT's family) trained on CORPUS."""
    from tokenizers import Tokenizer

    return LayaTokenizer.from_tokenizer(Tokenizer.from_str(_tokenizer_json(vocab_size)), dict(TOKENIZER_CONFIG))


TOKENIZER_CONFIG = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
                    "cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]", "pad_token": "[PAD]",
                    "unk_token": "[UNK]"}


@lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    """Trained once per process: several test fixtures share one vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    return tok.to_str()


def encoder_config(arch: str, vocab_size: int, hidden: int, layers: int, pad_id: int, cls_id: int,
                   sep_id: int, local_attention: int = 32, overrides: dict[str, Any] | None = None):
    """A transformers encoder config; `overrides` go to the constructor (ModernBERT derives layer_types there)."""
    from transformers import BertConfig, ModernBertConfig

    if arch == "modernbert":
        kwargs = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 3 // 2,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 32),
                      local_attention=local_attention, global_attn_every_n_layers=2,
                      max_position_embeddings=8192, pad_token_id=pad_id, bos_token_id=cls_id,
                      eos_token_id=sep_id, cls_token_id=cls_id, sep_token_id=sep_id)
        return ModernBertConfig(**{**kwargs, **(overrides or {})})
    if arch == "bert":
        kwargs = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 32),
                      max_position_embeddings=1024, pad_token_id=pad_id)
        return BertConfig(**{**kwargs, **(overrides or {})})
    raise ValueError(f"arch: expected 'modernbert' or 'bert', got {arch!r}")


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter with draws that depend only on (seed, name, shape)."""
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            digest = hashlib.sha256((f"{seed}:{name}").encode()).digest()
            gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.dim() >= 2:
                scale = 1.0 if name.startswith(("type_emb", "encoder.embeddings")) else param.shape[-1] ** -0.5
                if name.startswith("scorer.3"):  # spread option logits over several units
                    scale *= 8.0
                param.copy_(noise * scale)
            elif name.endswith("weight"):        # norm gains
                param.copy_(1.0 + 0.1 * noise)
            else:                                # biases
                param.copy_(0.1 * noise)


def build_checkpoint(path: str | os.PathLike, arch: str = "modernbert", seed: int = 0, hidden: int = 64,
                     layers: int = 2, head_layers: int = 1, vocab_size: int = 512, dtype: str = "f16",
                     act_costs: dict[str, float] | None = None, temperature: list[Any] | None = None,
                     temperature_by_options: dict[str, Any] | None = None, max_len: int | None = None,
                     head_max_len: int | None = None, local_attention: int = 32,
                     tokenizer_dir: str | None = None, encoder_overrides: dict[str, Any] | None = None) -> str:
    """Write a random checkpoint to `path` (returned as str); same arguments, same files.

    `tokenizer_dir` takes a real tokenizer folder instead of the trained toy BPE (realistic token
    counts for benchmarks); `encoder_overrides` sets encoder config fields (e.g. base-size dims).
    """
    path = str(path)
    tok = LayaTokenizer.from_dir(tokenizer_dir) if tokenizer_dir else train_tokenizer(vocab_size)
    ecfg = encoder_config(arch, tok.tokenizer.get_vocab_size(), hidden, layers, tok.pad_token_id,
                          tok.cls_token_id, tok.sep_token_id, local_attention, encoder_overrides)
    extra = {}
    if max_len is not None:
        extra["max_len"] = max_len
    if head_max_len is not None:
        extra["head_max_len"] = head_max_len
    config = LayaConfig(encoder=f"random-{arch}", head_layers=head_layers,
                        act_costs={"ask": 0.1, "escalate": 0.3} if act_costs is None else act_costs,
                        temperature=[1.3, 0.8, 2.0] if temperature is None else temperature,
                        temperature_by_options=({"choice:3-5": 1.7, "score:3-5": 0.9}
                                                if temperature_by_options is None else temperature_by_options),
                        **extra)
    model = LayaModel.from_encoder_config(ecfg, config)
    randomize_(model, seed)
    model.temperature.copy_(torch.tensor([float(t) if isinstance(t, (int, float)) else 1.0
                                          for t in config.temperature]))
    save_checkpoint(path, model, tok, config, torch.float16 if dtype == "f16" else torch.float32)
    return path


MODERNBERT_BASE = {"intermediate_size": 1152, "num_attention_heads": 12, "global_attn_every_n_layers": 3,
                   "vocab_size": 50368}


def build_base_checkpoint(path: str | os.PathLike, seed: int = 0) -> str:
    """A random checkpoint of ModernBERT-base size (149M encoder parameters, 2 head layers) for benchmarks."""
    return build_checkpoint(path, arch="modernbert", seed=seed, hidden=768, layers=22, head_layers=2,
                            local_attention=128, tokenizer_dir=str(minilm_dir()), encoder_overrides=MODERNBERT_BASE)


def packed_bf16_agent(path: str | os.PathLike):
    """An `Agent` on the packed bf16 engine whatever this CPU has: `laya.load` runs bf16 only where the CPU
    has bf16 units; elsewhere oneDNN emulates bf16, slowly but under the same determinism rules."""
    from laya.agent import Agent
    from laya.layout import read_parts
    from laya.packed_engine import PackedEngine
    from laya.precision import Plan

    config, encoder_config, tokenizer, weights_path = read_parts(str(path))
    return Agent(PackedEngine(encoder_config, config, weights_path, Plan("bf16", "bf16", "torch", "cpu", "test")),
                 tokenizer, config, source=str(path))


# Two held-out CLINC domains (as in the real split) and two trained ones.
TINY_CLINC_DOMAINS = {
    "utility": ["weather", "timer", "alarm", "date", "calculator"],
    "travel": ["book_hotel", "book_flight", "flight_status", "exchange_rate", "travel_alert"],
    "banking": ["transfer", "balance", "freeze_account", "bill_due", "pay_bill"],
    "kitchen_and_dining": ["recipe", "calories", "restaurant_reviews", "meal_suggestion", "cook_time"],
}


def write_intent_data(root: os.PathLike | str, domains: dict[str, list[str]] | None = None) -> Path:
    """A shared-data folder in CLINC150's and Snips' file formats with a few utterances per intent (whose words
    make text and label overlap), for tests that must not depend on ../shared/data being there."""
    import json

    from laya.corpus import intents

    root = Path(root)
    domains = domains or TINY_CLINC_DOMAINS

    def utter(y: str, i: int) -> str:
        return f"please {intents.humanise(y)} for me number {i}"

    full = {split: [[utter(y, i), y] for ys in domains.values() for y in ys for i in range(n)]
            for split, n in (("train", 6), ("val", 2), ("test", 4))}
    full |= {f"oos_{s}": [[f"tell me a joke {i}", "oos"] for i in range(3)] for s in ("train", "val", "test")}
    (root / "clinc150").mkdir(parents=True, exist_ok=True)
    (root / "clinc150" / "data_full.json").write_text(json.dumps(full))
    (root / "clinc150" / "domains.json").write_text(json.dumps(domains))
    (root / "snips").mkdir(exist_ok=True)
    for split, n in (("train", 8), ("validate", 4)):
        for y in intents.SNIPS_INTENTS:
            rows = [{"data": [{"text": "could you "}, {"text": intents.humanise(y), "entity": "x"},
                              {"text": f" now {i}"}]} for i in range(n)]
            (root / "snips" / f"{split}_{y}.json").write_text(json.dumps({y: rows}), encoding="latin-1")
    return root
