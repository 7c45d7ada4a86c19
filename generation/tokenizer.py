"""Text <-> token ids and the chat template, from a Hugging Face folder or GGUF metadata.

Built on the `tokenizers` library alone (no transformers at run time). A GGUF file carries its
vocabulary, merges and template as metadata; we rebuild a byte-level BPE from them the way
transformers' GGUF converter does, and the tests check both agree.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from generation.config import InvalidParam

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells byte b as one printable character; this maps it back."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, *, chat_template: str | None = None, bos_token: str | None = None,
                 eos_token: str | None = None, add_bos: bool = False) -> None:
        self.tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_id = tokenizer.token_to_id(bos_token) if bos_token else None
        self.add_bos = add_bos and self.bos_id is not None
        self._added_ids = set(tokenizer.get_added_tokens_decoder())

    def encode(self, text: str) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if self.add_bos else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes one token stands for, even when they are not whole UTF-8 characters (a byte-level
        BPE splits an emoji over several tokens): what an API's per-token logprobs report as `bytes`."""
        piece = self.tok.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self.tok.decoder, decoders.ByteLevel) and token_id not in self._added_ids:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        match = _BYTE_TOKEN.fullmatch(piece)  # sentencepiece byte fallback
        if match:
            return bytes([int(match.group(1), 16)])
        return self.tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render messages with the model's own template (sandboxed jinja, as transformers does).

        A message's `content` is a string or a list of text parts (`{"type": "text", "text": ...}`, the
        OpenAI form); parts are joined with newlines before the template sees them, since templates of
        text models read `content` as a string. `tools` reaches the template as transformers passes it
        (None without), so a template written for tool use shows them to the model."""
        if not self.chat_template:
            raise InvalidParam("messages: this model has no chat template; pass a plain prompt instead", "messages")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=[_flat_message(m, i) for i, m in enumerate(messages)],
            add_generation_prompt=add_generation_prompt, tools=tools,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )

    @classmethod
    def from_folder(cls, folder: Path) -> TextTokenizer:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (folder / "tokenizer_config.json").exists():
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()

        def name(t: Any) -> str | None:
            return t.get("content") if isinstance(t, dict) else t

        return cls(tok, chat_template=template, bos_token=name(cfg.get("bos_token")),
                   eos_token=name(cfg.get("eos_token")), add_bos=bool(cfg.get("add_bos_token", False)))

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> TextTokenizer:
        kind = fields.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"model: GGUF tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        types: list[int] = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
        tok.add_special_tokens(control)

        def tok_name(key: str) -> str | None:
            i = fields.get(key)
            return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

        # SmolLM-style GGUFs set bos == eos == <|im_start|>; the chat turn really ends with <|im_end|>.
        eos = "<|im_end|>" if "<|im_end|>" in vocab else tok_name("tokenizer.ggml.eos_token_id")
        return cls(tok, chat_template=fields.get("tokenizer.chat_template"), bos_token=tok_name("tokenizer.ggml.bos_token_id"),
                   eos_token=eos, add_bos=False)


def _flat_message(message: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise InvalidParam(f"{where}: must be an object with role and content", where)
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidParam(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                   "are supported", f"{where}.content[{j}]")
            texts.append(part["text"])
        return {**message, "content": "\n".join(texts)}
    if not isinstance(content, str):
        raise InvalidParam(f"{where}.content: must be a string or a list of text parts", f"{where}.content")
    return message
