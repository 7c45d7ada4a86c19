"""`GenerateApi`: the generation API as the app factory mounts it, its routes and what it adds to the server.

OpenAI (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`), SGLang's native routes (`/generate`,
`/get_model_info`, `/server_info`, `/flush_cache`, `/health_generate`), pins (`/v1/pins`), and vLLM's
`/tokenize` and `/detokenize`. Views stay
plain Flask: read the body, let `schema` check it, let `service` submit it, let a dialect write the answer
or the stream. Errors on `/v1/*` take OpenAI's shape (`openai.error_dialect`); SGLang's routes keep the
server's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flask import Blueprint, g, request
from prometheus_client import CollectorRegistry

from serving.errors import PEER_GONE_KEY, parse_json
from serving.generate import openai, responses, sglang
from serving.generate.config import GenerateConfig
from serving.generate.openapi import openapi
from serving.generate.schema import (
    chat_request,
    completion_request,
    detokenize_request,
    generate_request,
    pin_request,
    tokenize_request,
)
from serving.generate.service import Service
from serving.generate.streaming import event_stream


class GenerateApi:
    name = "generate"

    def __init__(self, cfg: GenerateConfig, model: str | None, engine: Any = None):
        """`model`: a path, or None for the embedded default. `engine` injects a loaded `Engine` (tests)."""
        self.cfg = cfg
        self.model = model
        self._engine = engine
        self.service: Service | None = None
        # a route it does not serve too (an SDK's 404); vLLM's tokenizer routes answer errors as its /v1/ do
        self.error_dialects = {"/v1/": openai.error_dialect, "/tokenize": openai.error_dialect,
                               "/detokenize": openai.error_dialect}
        self.blueprint = Blueprint("generate", __name__)
        for rule, view, methods in (
            ("/v1/chat/completions", self.chat, ["POST"]), ("/v1/completions", self.completions, ["POST"]),
            ("/v1/responses", self.responses, ["POST"]),
            ("/v1/pins", self.create_pin, ["POST"]), ("/v1/pins", self.list_pins, ["GET"]),
            ("/v1/pins/<pin_id>", self.delete_pin, ["DELETE"]),
            ("/generate", self.generate, ["POST"]), ("/get_model_info", self.model_info, ["GET"]),
            ("/server_info", self.server_info, ["GET"]), ("/flush_cache", self.flush_cache, ["POST"]),
            ("/health_generate", self.health_generate, ["GET"]),
            ("/tokenize", self.tokenize, ["POST"]), ("/detokenize", self.detokenize, ["POST"]),
        ):
            self.blueprint.add_url_rule(rule, view_func=view, methods=methods, endpoint=f"{view.__name__}")

    # What the app factory asks of every API.

    def start(self, registry: CollectorRegistry) -> None:
        self.service = Service(self.cfg, self.model, registry, self._engine)
        self.loaded = self.service.loaded

    @property
    def error(self) -> str | None:
        return self.service.error

    def status(self) -> dict:
        return {"generate_model": self.service.name}

    def models(self) -> dict:
        data = [] if not self.service.loaded.is_set() else [{
            "id": self.service.name, "object": "model", "created": self.service.created, "owned_by": "pagoda",
            "kind": "generation", "max_model_len": self.service.engine.max_model_len}]
        return {"data": data}

    def health(self) -> dict:
        return {"generate": {"model": self.service.name, "loaded": self.service.loaded.is_set()}}

    def stats(self) -> dict:
        return {"generation": {**(self.service.engine_stats() or {}), **self.service.metrics.stats()}}

    def openapi(self) -> dict:
        return openapi(self.cfg)

    def close(self, timeout_s: float) -> None:
        if self.service is not None:
            self.service.close(timeout_s)

    # OpenAI.

    def chat(self) -> Any:
        return self._openai(chat_request, openai.chat_completion, openai.chat_stream)

    def completions(self) -> Any:
        return self._openai(completion_request, openai.completion, openai.completion_stream)

    def _openai(self, parse: Callable, answer: Callable, stream: Callable) -> Any:
        req = parse(self._body(), self.cfg)
        run = self.service.start(req, g.t0, gone=_peer_gone())
        return event_stream(stream(run, self.service, g.request_id), run) if req.stream else answer(run, self.service)

    def responses(self) -> Any:
        req, echo = responses.responses_request(self._body(), self.cfg)
        run = self.service.start(req, g.t0, gone=_peer_gone())
        if req.stream:
            return event_stream(responses.stream(run, self.service, echo, g.request_id), run)
        return responses.answer(run, self.service, echo)

    # Pins.

    def create_pin(self) -> dict:
        kind, value = pin_request(self._body())
        self.service.ready()
        return self.service.pin(self.service.encode(value, kind, generation_prompt=False), g.t0)

    def list_pins(self) -> dict:
        return {"object": "list", "data": self.service.pins()}

    def delete_pin(self, pin_id: str) -> dict:
        self.service.unpin(pin_id)
        return {"id": pin_id, "object": "pin", "deleted": True}

    # SGLang.

    def generate(self) -> Any:
        req = generate_request(self._body(), self.cfg)
        run = self.service.start(req, g.t0, lambda ids: sglang.prompt_logprobs_from(req, ids), _peer_gone())
        if req.stream:
            return event_stream(sglang.generate_stream(run, self.service, g.request_id), run)
        return sglang.generate(run, self.service)

    def model_info(self) -> dict:
        """SGLang's: `model_path` is the file or folder served (the embedded default's too), so a frontend on this
        host reads the chat template from it (`generation.lang.HttpBackend`)."""
        from generation.weights import default_model_path

        path = str(self.service.model or default_model_path())
        return {"model_path": path, "tokenizer_path": path, "is_generation": True,
                "served_model_name": self.service.name}

    def server_info(self) -> dict:
        loop = self.service.ready()
        engine = self.service.engine
        return {"version": _version(), "model_path": self.model_info()["model_path"],
                "served_model_name": self.service.name, "max_total_num_tokens": engine.blocks.num_blocks * engine.config.block_size,
                "max_model_len": engine.max_model_len, "engine": {k: getattr(engine.config, k) for k in (
                    "cache_backend", "device", "dtype", "block_size", "max_num_seqs", "max_num_batched_tokens",
                    "chunked_prefill", "scheduling")},
                "internal_states": [loop.stats()]}

    def flush_cache(self) -> dict:
        return {"flushed_blocks": self.service.ready().flush_cache()}

    def health_generate(self) -> dict:
        return {"status": self.service.health(self.cfg.health_timeout_s)}

    # vLLM's tokenizer routes.

    def tokenize(self) -> dict:
        """The ids the generation routes would feed the model for this prompt or conversation, counted even
        past the prompt limit (a client asks in order to know whether it fits)."""
        req = tokenize_request(self._body(), self.cfg)
        self.service.ready()
        self.service.check_model(req.model)
        ids = self.service.tokens(req.prompt, req.where, req.add_generation_prompt, req.tools)
        bos = self.service.engine.tokenizer.bos_id
        if not req.add_special_tokens and ids and ids[0] == bos and self.service.engine.tokenizer.add_bos:
            ids = ids[1:]  # the only special token the tokenizer itself adds
        strs = [self.service.token_text(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.service.engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self) -> dict:
        ids, model = detokenize_request(self._body())
        self.service.ready()
        self.service.check_model(model)
        self.service.tokens(ids, "tokens")  # checked against the vocabulary
        return {"prompt": self.service.engine.tokenizer.decode(ids, skip_special_tokens=False)}

    def _body(self) -> Any:
        return parse_json(request.get_data(cache=False))


def _peer_gone() -> Any:
    """The front's flag for this request's client having gone (absent where no pagoda front runs the app: a
    test client)."""
    return request.environ.get(PEER_GONE_KEY)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pagoda")
    except PackageNotFoundError:
        return "0+unknown"

