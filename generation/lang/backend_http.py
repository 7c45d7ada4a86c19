"""Programs against a `/generate` server, speaking it as SGLang's `RuntimeEndpoint` does, so the same
program runs against `pagoda serve` or an SGLang server.

The requests, in SGLang's shapes: `GET /get_model_info` once; a `gen` is one `/generate` with the text so
far and `sampling_params` (the same keys RuntimeEndpoint sends, with `regex` / `json_schema` for
constraints and SSE for streaming); a fork first sends the prefix with `max_new_tokens: 0`, which leaves
it in the server's prefix cache; a `select` sends the text (to learn its token count) and then every
text + choice in one batch with `return_logprob` and `logprob_start_len` two tokens before the prompt's
end, and reads the prompt logprobs. The one departure: the unconditional pass of
`unconditional_likelihood_normalized` sends `logprob_start_len: 0`, since both servers return no prompt
logprobs for SGLang's default -1.

Role blocks need the model's chat template, which `/get_model_info` does not carry: it is read from the
model's files at the `model_path` the server reports when this machine can read them (a server on the
same host), or from `HttpBackend(..., model_path=...)`.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import requests

from generation.lang.backend import Backend, OnText
from generation.lang.chat_template import ChatTemplate
from generation.lang.choices import ChoiceScores
from generation.lang.errors import CallSite, LangError
from generation.lang.ir import GenParams


class HttpBackend(Backend):
    def __init__(self, base_url: str, *, api_key: str | None = None, model_path: str | Path | None = None,
                 timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._local = threading.local()  # one keep-alive session per thread
        answer = self._session().get(self.base_url + "/get_model_info", headers=self._headers, timeout=timeout)
        if answer.status_code != 200:
            raise RuntimeError(f"{self.base_url}/get_model_info answered {answer.status_code}: {answer.text[:300]}")
        self.model_info: dict[str, Any] = answer.json()
        self._template = _chat_template(model_path or self.model_info.get("tokenizer_path")
                                        or self.model_info.get("model_path"))

    def chat_template(self) -> ChatTemplate | None:
        return self._template

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
        return session

    def _post(self, body: dict[str, Any], site: CallSite, stream: bool = False) -> requests.Response:
        try:
            answer = self._session().post(self.base_url + "/generate", json=body, headers=self._headers,
                                          timeout=self.timeout, stream=stream)
        except requests.RequestException as exc:
            raise LangError(site, f"{self.base_url}/generate: {type(exc).__name__}: {exc}") from None
        if answer.status_code != 200:
            raise LangError(site, f"{self.base_url}/generate answered {answer.status_code}: {_error_text(answer)}")
        return answer

    def _generate(self, body: dict[str, Any], site: CallSite) -> Any:
        return self._post(body, site).json()

    def generate(self, text: str, params: GenParams, site: CallSite, on_text: OnText | None = None,
                 shared: Any = None) -> tuple[str, dict]:
        body: dict[str, Any] = {"text": text, "sampling_params": _sampling_params(params)}
        if params.return_logprob:
            body.update(return_logprob=True, return_text_in_logprobs=True)
            if params.top_logprobs_num:
                body["top_logprobs_num"] = params.top_logprobs_num
        if on_text is None:
            answer = self._generate(body, site)
            return answer["text"], answer["meta_info"]
        body["stream"] = True
        sent, meta = "", {}
        with self._post(body, site, stream=True) as answer:
            for line in answer.iter_lines(decode_unicode=False):
                line = line.decode("utf-8")
                if not line.startswith("data:"):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[len("data:"):])
                if "error" in chunk:
                    raise LangError(site, f"{self.base_url}/generate stream: {_message(chunk)}")
                piece, sent, meta = chunk["text"][len(sent):], chunk["text"], chunk["meta_info"]
                if piece:
                    on_text(piece)
        return sent, meta

    def choice_scores(self, text: str, choices: list[str], unconditional: bool, site: CallSite,
                      shared: Any = None) -> ChoiceScores:
        prompt_tokens = 0
        if text:
            prompt_tokens = self._generate({"text": text, "sampling_params": {"max_new_tokens": 0}}, site)[
                "meta_info"]["prompt_tokens"]
        answers = self._generate({"text": [text + c for c in choices],
                                  "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                                  "return_logprob": True, "return_text_in_logprobs": True,
                                  "logprob_start_len": max(prompt_tokens - 2, 0)}, site)
        # the first entry is the token at logprob_start_len, which has no score: see choices.scored_from
        entries = [[tuple(e) for e in a["meta_info"]["input_token_logprobs"][1:]] for a in answers]
        scores = ChoiceScores(list(choices), entries)
        if unconditional:
            alone = [[e[1] for e in es] for es in entries if es]
            scored = iter(self._generate({"input_ids": alone, "sampling_params": {"max_new_tokens": 0},
                                          "return_logprob": True, "logprob_start_len": 0}, site) if alone else [])
            scores.unconditional = [[e[0] or 0.0 for e in next(scored)["meta_info"]["input_token_logprobs"]] if es else []
                                    for es in entries]
        return scores

    def share_prefix(self, text: str, site: CallSite) -> None:
        self._generate({"text": text, "sampling_params": {"max_new_tokens": 0}}, site)


def _sampling_params(p: GenParams) -> dict[str, Any]:
    """`sampling_params` as RuntimeEndpoint writes them (its no-op fields included)."""
    out = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": p.max_new_tokens,
           "min_new_tokens": p.min_new_tokens or 0, "n": 1, "stop": p.stops, "stop_token_ids": list(p.stop_token_ids or []),
           "stop_regex": [], "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p,
           "frequency_penalty": p.frequency_penalty, "presence_penalty": p.presence_penalty,
           "ignore_eos": p.ignore_eos, "regex": p.regex, "json_schema": p.json_schema}
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


def _message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        field = f" (field {error['field']})" if error.get("field") else ""
        return f"{error.get('message', error)}{field}"
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return str(error or body)[:500]


def _error_text(answer: requests.Response) -> str:
    try:
        return _message(answer.json())
    except ValueError:
        return answer.text[:500]


def _chat_template(path: str | Path | None) -> ChatTemplate | None:
    """The template in a model folder or GGUF file this machine can read; None otherwise."""
    if not path:
        return None
    from generation.tokenizer import TextTokenizer

    path = Path(path)
    if path.is_dir() and (path / "tokenizer.json").exists():
        tokenizer = TextTokenizer.from_folder(path)
    elif path.suffix == ".gguf" and path.is_file():
        from gguf import GGUFReader

        fields = {k: f.contents() for k, f in GGUFReader(str(path)).fields.items() if k.startswith("tokenizer.")}
        tokenizer = TextTokenizer.from_gguf_fields(fields)
    else:
        return None
    if not tokenizer.chat_template:
        return None
    return ChatTemplate(lambda messages: tokenizer.apply_chat_template(messages, False))
