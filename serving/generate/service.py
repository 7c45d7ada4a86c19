"""The LLM in a serving process: its lifecycle, and one request's path from body to engine events.

The engine loads in a background thread (the process answers `/health` at once; `/ready` says 503 until
the weights are in memory), then one `EngineLoop` owns it: every request thread submits to that loop and
reads its own events, so requests from all clients share the engine's continuous batch and nothing
serialises them behind a lock. `start` turns a parsed `Request` into token ids (chat template, pins),
`SamplingParams` (the engine validates; its `InvalidParam` comes back as a 400 naming the body field) and
one `submit_batch` of prompts x n choices; the `Run` it returns is what the dialects read.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from generation.config import InvalidParam, SamplingParams
from serving.errors import ApiError, PeerGone, client_gone
from serving.generate.body import bad
from serving.generate.config import GenerateConfig
from serving.generate.metrics import GenerateMetrics
from serving.generate.schema import Request
from serving.generate.tools import ToolCalling

log = logging.getLogger("pagoda.serve")
DRAIN_GRACE_S = 30.0  # past the deadline, the loop has surely delivered the final event; more is a bug
SETTLE_S = 0.5  # how long a request ended by one choice's deadline waits for its other choices' (`Run._settle`)
GONE = object()  # what a run's event queue gets when its client leaves (`PeerGone.when_set`): it wakes at once


def body_field(req: Request, field: str, default: str | None = None, prompt: int = 0) -> str:
    """The body field behind an engine `InvalidParam.field`; a constraint's own path continues the body
    field it came from (`BodyConstraint.field_of`)."""
    c = req.constraint
    if c is not None and (field == "constraint" or field.startswith("constraint.")):
        return c.field_of(field)
    return req.names[prompt].get(field, default or field)


def failure(out: Any) -> ApiError | None:
    """Why a choice has no answer, as the error the request gets; None for a normal end."""
    if out.finish_reason in ("stop", "length"):
        return None
    if out.finish_reason == "deadline":
        return ApiError(504, "the generation passed its deadline (--generate-deadline-s)", "timeout")
    if out.finish_reason == "error" and out.no_room:  # a capacity state any client's pins can cause: not a 500
        return ApiError(507, f"no room in the KV pool: {out.error}", "insufficient_storage")
    if out.finish_reason == "error":
        return ApiError(500, f"the generation failed: {out.error}", "model_error")
    return ApiError(503, "the generation was aborted (the server is shutting down)", "aborted",
                    headers={"Retry-After": "1"})


def build_engine(cfg: GenerateConfig, model: str | None) -> Any:
    """The engine the generation settings describe: the one place a served engine is built, so the one a
    preloading master builds before the fork and the one a worker builds cannot differ."""
    from generation.config import EngineConfig
    from generation.engine import Engine

    try:
        return Engine(EngineConfig(
            model=model, cache_backend=cfg.cache_backend, device=cfg.device, dtype=cfg.dtype, block_size=cfg.block_size,
            num_blocks=cfg.num_blocks, kv_cache_memory_mb=cfg.kv_cache_mb, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens, chunked_prefill=cfg.chunked_prefill,
            scheduling=cfg.scheduling, max_model_len=cfg.max_model_len, max_pinned_fraction=cfg.max_pinned_fraction))
    except InvalidParam as exc:  # a setting only the model can judge (a length past its positions): by its flag
        name = {"kv_cache_memory_mb": "kv_cache_mb"}.get(exc.field, exc.field)
        if name not in {f.name for f in dataclasses.fields(cfg)}:
            raise
        raise InvalidParam(f"{cfg.where(name)}: {exc.reason}", name) from None


class Run:
    """One request in flight: prompts x n choices in one engine batch (batch index = prompt * n + choice).

    `events()` yields `(choice, event)` as the engine produces them and records the latencies the metrics
    want; closing it early (a client gone) aborts every choice, so their blocks return to the pool."""

    def __init__(self, service: Service, req: Request, batch: Any, prompt_ids: list[list[int]], t0: float,
                 deadline: float, gone: PeerGone | None = None):
        """`gone`: set when the client has closed its connection (`serving.errors.PEER_GONE_KEY`)."""
        self.service = service
        self.gone = gone
        self.req = req
        self.batch = batch
        self.prompt_ids = prompt_ids
        self.t0 = t0
        self.deadline = deadline
        self.outputs: list[Any] = [None] * len(batch.handles)
        self.first_token: float | None = None
        self._last: dict[int, float] = {}
        self._streamed: dict[int, int] = {}  # tokens each choice produced, for one its client cut off
        self._gaps: list[float] = []
        self._done = False
        self._observed = False

    @property
    def n_choices(self) -> int:
        return len(self.outputs)

    def events(self) -> Iterator[tuple[int, Any]]:
        from generation.engine import GenerationOutput

        left = self.n_choices
        events = self.batch.events
        cancel = self.gone.when_set(lambda: events.put(GONE)) if self.gone is not None else None
        try:
            while left:
                remaining = self.deadline + DRAIN_GRACE_S - time.monotonic()
                try:
                    event = events.get(timeout=max(1.0, remaining))
                except queue.Empty:
                    raise ApiError(504, "the engine did not answer in time", "timeout") from None
                if event is GONE:
                    raise client_gone()
                now = time.monotonic()
                if isinstance(event, GenerationOutput):
                    self.outputs[event.index] = event
                    left -= 1
                else:
                    if self.first_token is None:
                        self.first_token = now
                    if event.index in self._last:
                        self._gaps.append(now - self._last[event.index])
                    self._last[event.index] = now
                    self._streamed[event.index] = self._streamed.get(event.index, 0) + 1
                yield event.index, event
            self._done = True  # everything ended on its own: nothing to abort
        finally:
            if cancel is not None:
                cancel()
            self.close()

    def close(self) -> None:
        """Count the request once, then abort every choice still running (a client gone, even before its stream
        began); idempotent. Counted first so that /stats never shows the engine idle with the request not yet in
        its finish reasons: a client that polled for the first then read the second raced it (seen in CI, Dec 4)."""
        try:
            if not self._observed:
                self._observed = True
                if not self._done:
                    self._settle()
                self._observe()
        finally:
            if not self._done:
                self._done = True
                self.batch.abort()

    def _settle(self) -> None:
        """Take the final events already on their way when the request ended early: the route stops at the
        first choice that failed, and the others, which ended as it did (choices past one deadline end in the
        same engine step), were counted as aborts (an n=8 stream past its deadline: 1 deadline, 7 aborts)."""
        from generation.engine import GenerationOutput

        failed = {o.finish_reason for o in self.outputs if o is not None} - {"stop", "length"}
        until = time.monotonic() + (SETTLE_S if "deadline" in failed else 0.0)
        while any(o is None for o in self.outputs):
            try:
                event = self.batch.events.get(timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                return
            if isinstance(event, GenerationOutput):
                self.outputs[event.index] = event

    def wait(self) -> list[Any]:
        """Every choice's GenerationOutput, in batch order."""
        for _ in self.events():
            pass
        return self.outputs

    def _observe(self) -> None:
        outs = [o for o in self.outputs if o is not None]
        reasons = [o.finish_reason for o in outs] + ["abort"] * (self.n_choices - len(outs))
        ttft = None if self.first_token is None else self.first_token - self.t0
        # a choice cut off before its end (its client left) still produced the tokens it streamed
        output = sum(len(o.token_ids) if o is not None else self._streamed.get(i, 0)
                     for i, o in enumerate(self.outputs))
        self.service.metrics.observe_request(self.req.route, reasons, sum(len(ids) for ids in self.prompt_ids),
                                             self.cached_tokens(), output, ttft, self._gaps,
                                             time.monotonic() - self.t0)

    def cached_tokens(self) -> int:
        """Prompt tokens the engine did not compute, a prompt counted once however many choices it has
        (its least-cached choice)."""
        n = self.req.n
        groups = [[o for o in self.outputs[i:i + n] if o is not None] for i in range(0, self.n_choices, n)]
        return sum(min(o.cached_tokens for o in group) for group in groups if group)

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage, with `prompt_tokens_details.cached_tokens`."""
        prompt = sum(len(ids) for ids in self.prompt_ids)
        completion = sum(len(o.token_ids) for o in self.outputs)
        cached = self.cached_tokens()
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class Service:
    """The loaded engine and its loop, or why there is none yet; pins created over HTTP."""

    def __init__(self, cfg: GenerateConfig, model: str | None, registry: Any, engine: Any = None):
        """Registers the series in `registry`, then attaches `engine` (already loaded: tests, embedding) or
        starts loading the model in the background."""
        self.cfg = cfg
        self.model = model
        self.engine: Any = None
        self.loop: Any = None
        self.error: str | None = None
        self.loaded = threading.Event()
        self.name = cfg.name or _model_name(model)
        self.created = int(time.time())
        self.metrics = GenerateMetrics(registry, self.engine_stats)
        self._pins: dict[str, list[int]] = {}  # pin id -> its tokens, for finding the pin a prompt extends
        self._pins_lock = threading.Lock()
        if engine is not None:
            self.attach(engine)
        else:
            self.load_in_background()

    # ---- lifecycle --------------------------------------------------------------------------------------

    def load_in_background(self) -> None:
        def load() -> None:
            try:
                started = time.monotonic()
                self.attach(build_engine(self.cfg, self.model))
                log.info("generation model %s ready in %.1fs", self.name, time.monotonic() - started)
            except Exception as exc:  # noqa: BLE001 -- reported by /ready and the log, not a crash loop
                self.error = f"{type(exc).__name__}: {exc}"
                log.exception("generation model failed to load")

        threading.Thread(target=load, name="pagoda-llm-load", daemon=True).start()

    def attach(self, engine: Any) -> None:
        from generation.engine_loop import EngineLoop

        self.engine = engine
        self.loop = EngineLoop(engine, max_waiting=self.cfg.max_waiting, num_threads=self.cfg.torch_threads or None)
        self.loaded.set()

    def close(self, timeout_s: float | None = None) -> None:
        """Abort what runs and end the loop thread, waiting at most `timeout_s` for it."""
        if self.loop is not None:
            self.loop.close(timeout=timeout_s)

    def ready(self) -> Any:
        if self.loop is None:
            raise ApiError(503, self.error or "the generation model is still loading", "not_ready",
                           headers={"Retry-After": "1"})
        return self.loop

    def engine_stats(self) -> dict | None:
        return self.loop.stats() if self.loop is not None else None

    @property
    def max_prompt_tokens(self) -> int:
        return min(self.cfg.max_prompt_tokens or self.engine.max_model_len, self.engine.max_model_len - 1)

    # ---- one request ------------------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404, f"model {model!r} is not served here; this server generates with {self.name!r}",
                           "model_not_found", "model")

    def tokens(self, prompt: Any, where: str, generation_prompt: bool = True,
               tools: ToolCalling | None = None) -> list[int]:
        """Token ids of a prompt: text, ids (checked against the vocabulary) or chat messages (rendered
        with the model's template, as `tools` shows them: `ToolCalling.shown`; `generation_prompt=False` for a
        prefix a later chat continues). No limit is applied: `/tokenize` counts a prompt too long to generate from."""
        engine = self.engine
        put_before = 0  # messages the tools put before the body's: an error's index is past the body's by that
        try:
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                shown, put_before = tools.shown(prompt) if tools is not None else (prompt, 0)
                prompt = engine.apply_chat_template(shown, add_generation_prompt=generation_prompt,
                                                    tools=tools.template_tools if tools is not None else None)
            return engine.encode(prompt)
        except InvalidParam as exc:
            if not exc.field.startswith("messages"):
                raise bad(where, exc.reason) from None
            raise bad(_shifted(exc.field, -put_before), exc.reason) from None

    def encode(self, prompt: Any, where: str, generation_prompt: bool = True,
               tools: ToolCalling | None = None) -> list[int]:
        """`tokens` of a prompt to generate from: at least one, and within the prompt limit."""
        ids = self.tokens(prompt, where, generation_prompt, tools)
        if not ids:
            raise bad(where, "empty (give at least one token)")
        if len(ids) > self.max_prompt_tokens:
            flag = ("--generate-max-prompt-tokens" if self.max_prompt_tokens == self.cfg.max_prompt_tokens else
                    "--generate-max-model-len, less the one token an answer needs")
            raise bad(where, f"{len(ids)} tokens, at most {self.max_prompt_tokens} ({flag})")
        return ids

    def fit_context(self, req: Request, i: int, n_prompt: int, params: SamplingParams) -> SamplingParams:
        """Prompt i's output budget inside the context. One the client set that does not fit is refused, as
        OpenAI, vLLM and SGLang refuse it (a silently shorter answer would read as a complete one); the
        server's default shrinks to what the context leaves."""
        room = self.engine.max_model_len - n_prompt
        if params.max_new_tokens <= room:
            return params
        if params.min_new_tokens > room:
            raise bad(req.names[i].get("min_new_tokens", "min_new_tokens"),
                      f"{n_prompt} prompt tokens + at least {params.min_new_tokens} new ones is over the model's "
                      f"context of {self.engine.max_model_len} tokens (--generate-max-model-len)")
        given = req.max_tokens_set[i] if i < len(req.max_tokens_set) else None
        if given is not None:
            raise bad(given, f"{n_prompt} prompt tokens + {params.max_new_tokens} new ones is over the model's "
                             f"context of {self.engine.max_model_len} tokens (--generate-max-model-len): ask for "
                             f"at most {room}")
        return dataclasses.replace(params, max_new_tokens=room)

    def params(self, req: Request, i: int) -> SamplingParams:
        """Prompt i's SamplingParams. A constraint rides in `SamplingParams.constraint`, as in-process: the
        engine compiles it when the request is checked (in this thread), and its errors name its path."""
        kw = dict(req.sampling[i])
        if req.constraint is not None:
            kw["constraint"] = req.constraint.params
            for part in req.constraint.parts():  # compiled and cached, so the whole's compile reuses nothing new
                try:
                    self.engine.check_request([0], SamplingParams(max_new_tokens=1, constraint=part.params))
                except InvalidParam as exc:
                    raise bad(part.field_of(exc.field), exc.reason) from None
        try:
            params = SamplingParams(**kw)
            self.engine.check_params(params)
        except InvalidParam as exc:
            raise bad(body_field(req, exc.field, prompt=i), exc.reason) from None
        return params

    def start(self, req: Request, t0: float,
              scoring: Callable[[list[list[int]]], list[int] | None] | None = None,
              gone: PeerGone | None = None) -> Run:
        """Submit every prompt x n choices at once (all or none). `scoring(prompt_ids)[i]`: score prompt
        i's tokens from that index on (SGLang's `logprob_start_len`, as its dialect reads it); `gone`: the
        client's connection closed (the run then aborts, whether or not it streams)."""
        loop = self.ready()
        self.check_model(req.model)
        prompt_ids = [self.encode(p, w, tools=req.tools) for p, w in zip(req.prompts, req.where)]
        sequences = len(req.prompts) * req.n
        if sequences > self.cfg.max_waiting:  # a 503 would say "retry", and no retry could ever fit it
            field = "n" if req.n > 1 else req.where[0].split("[")[0]
            raise bad(field, f"{len(req.prompts)} prompt(s) x n={req.n} is {sequences} sequences, more than the "
                             f"{self.cfg.max_waiting} the queue holds (--generate-max-waiting): send fewer at once")
        prompt_logprobs_from = scoring(prompt_ids) if scoring else None
        prompts, params, pins = [], [], []
        for i, ids in enumerate(prompt_ids):
            base = self.fit_context(req, i, len(ids), self.params(req, i))
            if prompt_logprobs_from is not None:
                base = dataclasses.replace(base, prompt_logprobs=req.top_logprobs_num,
                                           prompt_logprobs_start=prompt_logprobs_from[i])
            pin, rest = self.pin_for(ids)
            for choice in range(req.n):
                sp = base if choice == 0 or base.seed is None else dataclasses.replace(base, seed=choice_seed(base.seed, choice))
                prompts.append(rest)
                params.append(sp)
                pins.append(pin)
        deadline = t0 + self.cfg.deadline_s
        batch = self._submit(loop, prompts, params, pins, deadline, req)
        return Run(self, req, batch, prompt_ids, t0, deadline, gone)

    def _submit(self, loop: Any, prompts: list, params: list, pins: list, deadline: float, req: Request) -> Any:
        from generation.engine_loop import QueueFull

        try:
            return loop.submit_batch(prompts, params, pins=pins, deadline=deadline)
        except QueueFull as exc:
            raise ApiError(503, f"server busy: {exc}", "overloaded", headers={"Retry-After": "1"}) from None
        except InvalidParam as exc:
            if exc.field == "pin" and any(pins):  # a pin released since we looked: go without it
                full = [self._pins_tokens(p) + ids if p else ids for p, ids in zip(pins, prompts)]
                return self._submit(loop, full, params, [None] * len(full), deadline, req)
            raise bad(body_field(req, exc.field, req.where[0]), exc.reason) from None

    # ---- pins -------------------------------------------------------------------------------------------

    def pin_for(self, ids: list[int]) -> tuple[str | None, list[int]]:
        """The longest HTTP pin the prompt extends, and the rest of the prompt after it."""
        with self._pins_lock:
            best = max(((pid, toks) for pid, toks in self._pins.items() if ids[:len(toks)] == toks),
                       key=lambda item: len(item[1]), default=None)
        if best is None:
            return None, ids
        return best[0], ids[len(best[1]):]

    def _pins_tokens(self, pin: str) -> list[int]:
        with self._pins_lock:
            return self._pins.get(pin, [])

    def health(self, timeout: float) -> str:
        """One greedy token through the engine loop (SGLang's `/health_generate`): "ok" when it comes, "busy"
        when it did not but engine steps went on ending meanwhile (long prefills ahead of it hold the step
        budget: SGLang too counts any progress as healthy), else a 503 saying why: no step ended for
        `timeout` (a stuck engine), or the probe's own error (a pool that pins fill)."""
        from generation.engine_loop import QueueFull

        loop = self.ready()
        started = time.monotonic()
        try:
            handle = loop.submit([0], SamplingParams(max_new_tokens=1, ignore_eos=True), deadline=started + timeout)
        except QueueFull as exc:
            raise ApiError(503, f"server busy: {exc}", "overloaded", headers={"Retry-After": "1"}) from None
        out = handle.result(timeout + DRAIN_GRACE_S)
        if out.finish_reason == "length":
            return "ok"
        if out.error:
            raise ApiError(503, f"the engine could not run a one-token probe: {out.error}", "unhealthy")
        if loop.last_step_end > started:
            return "busy"
        raise ApiError(503, f"no engine step ended within {timeout:g}s (--generate-health-timeout-s)", "unhealthy")

    def pin(self, ids: list[int], t0: float) -> dict:
        loop = self.ready()
        from generation.engine_loop import QueueFull

        try:
            pin_id = loop.pin(ids, timeout=max(1.0, t0 + self.cfg.deadline_s - time.monotonic()))
        except QueueFull as exc:
            raise ApiError(503, f"server busy: {exc}", "overloaded", headers={"Retry-After": "1"}) from None
        except TimeoutError:
            raise ApiError(504, "the pin was not computed within the deadline", "timeout") from None
        except RuntimeError as exc:  # the pool cannot hold it
            raise ApiError(507, f"could not pin: {exc}", "insufficient_storage") from None
        with self._pins_lock:
            self._pins[pin_id] = ids
        return self.describe_pin(pin_id, loop.pins()[pin_id])

    def pins(self) -> list[dict]:
        held = self.ready().pins()
        with self._pins_lock:
            return [self.describe_pin(pid, held[pid]) for pid in self._pins if pid in held]

    def unpin(self, pin_id: str) -> None:
        with self._pins_lock:
            known = self._pins.pop(pin_id, None)
        if known is None:
            raise ApiError(404, f"no pin {pin_id!r}", "not_found", "pin")
        self.ready().unpin(pin_id)

    @staticmethod
    def describe_pin(pin_id: str, held: dict) -> dict:
        return {"id": pin_id, "object": "pin", "tokens": held["tokens"], "blocks": held["blocks"]}

    # ---- what the model is ------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        return self.engine.tokenizer.token_bytes(token_id)


def _shifted(field: str, by: int) -> str:
    """`messages[i]...` as `messages[i + by]...`: the template's index of a message, as the body's."""
    if not by or not field.startswith("messages["):
        return field
    index, rest = field[len("messages["):].split("]", 1)
    return f"messages[{int(index) + by}]{rest}"


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` > 0 of a seeded request: n samples must differ, and reproducibly."""
    return (seed + choice * 0x9E3779B97F4A7C15) % 2**63


def _model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem.split(".")[0] if path.suffix == ".gguf" else path.resolve().name
