"""Tiny random Llama models built with transformers, saved as real HF folders for the engine to load, and
transformers' own greedy decoding as the reference. Imported by tests/generation and tests/serving."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "paged attention keeps key value blocks in a shared pool",
    "a radix tree finds the longest cached prefix of every prompt",
    "hello world, this is pagoda generating text on a small cpu",
    "numbers 0 1 2 3 4 5 6 7 8 9 and symbols ! ? . , ; :",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_llama(folder: Path, *, seed: int = 0, tie: bool = False, kv_heads: int = 2, rope_scaling: dict | None = None,
                     max_positions: int = 1024) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
        initializer_range=0.3, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_scaling=rope_scaling,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(folder)
    return folder


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers' own generate, one prompt at a time (no padding effects), EOS ignored."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                               min_new_tokens=0, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs
