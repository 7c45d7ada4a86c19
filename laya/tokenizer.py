"""The checkpoint tokenizer, read straight from `tokenizer/tokenizer.json` with `tokenizers`.

The official runtime goes through `transformers.AutoTokenizer`, whose `__call__` with
`add_special_tokens=False` ends in the same `tokenizers` encode; calling it directly skips a
Python layer per text and lets one call encode a whole batch of texts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

SPECIAL = ("cls_token", "sep_token", "mask_token", "pad_token")


@dataclass
class LayaTokenizer:
    tokenizer: Any             # tokenizers.Tokenizer
    config: dict[str, Any]     # tokenizer_config.json, kept to write it back unchanged
    cls_token_id: int
    sep_token_id: int
    mask_token_id: int
    pad_token_id: int
    mask_token: str

    @classmethod
    def from_dir(cls, path: str) -> LayaTokenizer:
        from tokenizers import Tokenizer

        files = {}
        for name in ("tokenizer.json", "tokenizer_config.json"):
            files[name] = os.path.join(path, name)
            if not os.path.isfile(files[name]):
                raise FileNotFoundError(f"checkpoint is missing tokenizer/{name} (looked for {files[name]})")
        tok = Tokenizer.from_file(files["tokenizer.json"])
        with open(files["tokenizer_config.json"], encoding="utf-8") as f:
            config = json.load(f)
        return cls.from_tokenizer(tok, config)

    @classmethod
    def from_tokenizer(cls, tok: Any, config: dict[str, Any]) -> LayaTokenizer:
        tok.no_truncation()
        tok.no_padding()
        ids = {}
        for field in SPECIAL:
            text = config.get(field)
            if isinstance(text, dict):
                text = text.get("content")
            if not isinstance(text, str):
                raise ValueError(f"tokenizer/tokenizer_config.json: {field} is missing")
            token_id = tok.token_to_id(text)
            if token_id is None:
                raise ValueError(f"tokenizer/tokenizer_config.json: {field} {text!r} is not in the vocabulary")
            ids[field] = (text, token_id)
        return cls(tok, config, ids["cls_token"][1], ids["sep_token"][1], ids["mask_token"][1],
                   ids["pad_token"][1], ids["mask_token"][0])

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids without special tokens, one list per text (a literal mask token becomes a space)."""
        clean = [t.replace(self.mask_token, " ") for t in texts]
        return [e.ids for e in self.tokenizer.encode_batch(clean, add_special_tokens=False)]

    def save(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        self.tokenizer.save(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(self.config, f, indent=2)
