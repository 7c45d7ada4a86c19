"""generation.lang on the local backend: the program model, select against a transformers forward, forks
computing their prefix once, run_batch, constraints inside gen, chat-role blocks, streaming, and errors
that name the program's line."""

from __future__ import annotations

import json
import math
import re
import threading

import pytest

from generation import Engine, EngineConfig, lang
from generation.lang.choices import scored_from
from generation.lang.state import ProgramState
from tests.generation.llama_builders import CHAT_TEMPLATE

CONTEXT = ("the quick brown fox jumps over the lazy dog. paged attention keeps key value blocks in a shared pool. "
           "a radix tree finds the longest cached prefix of every prompt.\n")


def make_engine(tiny_llama, **kw) -> Engine:
    return Engine(EngineConfig(model=str(tiny_llama), block_size=4, num_blocks=512, **kw))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return make_engine(tiny_llama)


@pytest.fixture(scope="module")
def local(engine):
    with lang.LocalBackend(engine) as backend:
        yield backend


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def hf_logprobs(hf_model, ids: list[int]) -> list[float]:
    """log p(ids[k] | ids[:k]) for k >= 1, from one transformers forward."""
    import torch

    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    return [float(logprobs[k - 1, ids[k]]) for k in range(1, len(ids))]


def reference_scores(hf_model, tokenizer, prefix: str, choices: list[str]) -> tuple[list[list[int]], list[list[float]]]:
    """Per choice, its scored tokens and their log-probabilities given everything before them."""
    start = scored_from(len(tokenizer.encode(prefix)))
    joint = [tokenizer.encode(prefix + choice) for choice in choices]
    return [ids[start:] for ids in joint], [hf_logprobs(hf_model, ids)[start - 1:] for ids in joint]


def argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


# ---- select -------------------------------------------------------------------------------------------

SELECT_CASES = [
    ("Question: what does the fox do?\nAnswer: ", ["jumps over the lazy dog", "a radix tree", "hello world"]),
    ("the lazy", [" dog", " fox", "dog jumps", " pool of blocks"]),  # leading spaces: the boundary token merges
    ("numbers 0 1 2 3", [" 4 5 6", " and symbols", "!"]),
]


@pytest.mark.parametrize("prefix,choices", SELECT_CASES)
def test_select_picks_the_choice_a_transformers_forward_ranks_first(local, hf_model, prefix, choices):
    @lang.function
    def pick(s):
        s += prefix + lang.select("pick", choices=choices)

    state = pick.run(backend=local)
    _, ref = reference_scores(hf_model, local.engine.tokenizer, prefix, choices)
    normalized = [sum(r) / len(r) for r in ref]
    got = state.get_meta_info("pick")["normalized_prompt_logprobs"]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, normalized))
    assert state["pick"] == choices[argmax(normalized)]
    assert state.text() == prefix + state["pick"]


def test_select_computes_its_text_once_and_each_choice_only_its_tail(tiny_llama):
    """The text is pinned while the choices are scored: a choice computes its tokens from the scoring window
    on; without the pin every choice recomputes the text's partial last block."""
    text, choices = CONTEXT + "Verdict:", [" jumps over", " the lazy dog", " radix", " pool blocks"]

    @lang.function
    def verdict(s):
        s += text + lang.select("v", choices=choices)

    figures = {}
    for pin in (True, False):
        with lang.LocalBackend(make_engine(tiny_llama), pin_prefixes=pin) as backend:
            state = verdict.run(backend=backend)
            figures[pin] = (computed(backend.loop.stats()), backend.loop.stats()["pins"], state["v"])
            encode = backend.engine.tokenizer.encode
    prompt = len(encode(text))
    tails = sum(len(encode(text + c)) - (prompt - 2) for c in choices)  # from the token before the window
    assert figures[True] == ((prompt - 1) + tails, 0, figures[False][2])
    assert figures[False][0] > figures[True][0]  # the pin costs less than recomputing partial blocks per choice


def test_the_other_choice_methods_against_transformers(local, hf_model):
    prefix, choices = "a radix tree finds the", [" longest", " longest cached prefix", " quick brown fox"]
    scored, ref = reference_scores(hf_model, local.engine.tokenizer, prefix, choices)

    @lang.function
    def pick(s, method):
        s += prefix + lang.select("pick", choices=choices, choices_method=method)

    greedy = pick.run(method=lang.greedy_token_selection, backend=local)
    width = max(map(len, ref))
    matrix = [r + [sum(r) / len(r)] * (width - len(r)) for r in ref]
    left = list(range(len(choices)))
    for j in range(width):
        if len(left) > 1:
            top = max(matrix[i][j] for i in left)
            left = [i for i in left if math.isclose(matrix[i][j], top, abs_tol=1e-5)]
    assert greedy["pick"] == choices[left[0]]

    uncond = pick.run(method=lang.unconditional_likelihood_normalized, backend=local)
    relative = []
    for ids, scores in zip(scored, ref):
        free = [0.0, *hf_logprobs(hf_model, ids)]  # each scored token given only the choice's earlier ones
        relative.append(sum(a - b for a, b in zip(scores, free)) / len(scores))
    got = uncond.get_meta_info("pick")["normalized_unconditional_prompt_logprobs"]
    assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(got, relative))
    assert uncond["pick"] == choices[argmax(relative)]


# ---- fork -----------------------------------------------------------------------------------------------

def computed(stats: dict) -> int:
    return stats["prompt_tokens"] - stats["compute_saved_tokens"]


def test_fork_4_computes_the_shared_prefix_once(tiny_llama):
    """Each branch continues the pinned prefix (all its tokens but the boundary one); without the pin and
    the cache every branch computes the whole prefix again."""
    @lang.function
    def branches(s):
        s += CONTEXT
        forks = s.fork(4)
        forks += lambda i: f"Branch {i}: " + lang.gen("idea", max_tokens=4, ignore_eos=True)
        forks.join()

    figures = {}
    for name, cache, pin in (("shared", "radix", True), ("independent", "none", False)):
        engine = make_engine(tiny_llama, cache_backend=cache)
        with lang.LocalBackend(engine, pin_prefixes=pin) as backend:
            state = branches.run(backend=backend, temperature=0)
            figures[name] = (state, backend.loop.stats())
    prefix = len(engine.tokenizer.encode(CONTEXT))
    shared, stats = figures["shared"]
    metas = shared.get_meta_info("idea")
    assert all(m["cached_tokens"] == prefix - 1 for m in metas)  # a full hit of the pin, in every branch
    branch_tokens = sum(m["prompt_tokens"] for m in metas)
    assert computed(stats) == (prefix - 1) + branch_tokens - 4 * (prefix - 1)  # the prefix once, then the tails
    assert stats["pins"] == 0  # the fork's pin went back when it joined
    independent, base = figures["independent"]
    assert computed(base) == branch_tokens and all(m["cached_tokens"] == 0 for m in independent.get_meta_info("idea"))
    assert shared["idea"] == independent["idea"]  # the same greedy text either way


def test_a_branchs_later_calls_hit_what_its_first_computed(tiny_llama):
    """The pin serves a branch's first call; the next one finds the branch's own text in the prefix cache
    (a pinned request would be matched only up to the pin's end)."""
    @lang.function
    def two_calls(s):
        s += CONTEXT
        forks = s.fork(2)
        forks += lambda i: f"Branch {i} says the quick brown fox jumps: " + lang.gen("first", max_tokens=3)
        forks += lang.gen("second", max_tokens=2, ignore_eos=True)
        forks.join()

    with lang.LocalBackend(make_engine(tiny_llama)) as backend:
        state = two_calls.run(backend=backend, temperature=0)
        encode = backend.engine.tokenizer.encode
    prefix, branches = encode(CONTEXT), [encode(CONTEXT + f"Branch {i} says the quick brown fox jumps: ") for i in (0, 1)]
    common = next(k for k, (a, b) in enumerate(zip(*branches)) if a != b)  # where the two branches part
    for ids, first, second in zip(branches, state.get_meta_info("first"), state.get_meta_info("second")):
        assert first["cached_tokens"] == len(prefix) - 1
        assert second["cached_tokens"] >= 4 * ((len(ids) - 1) // 4) > 4 * (common // 4) + 4


def test_join_gathers_variables_or_concatenates_text(local):
    @lang.function
    def both(s):
        s += "hello world, "
        forks = s.fork(3)
        forks += [f"item {i}: " for i in range(3)]
        forks += lang.gen("word", max_tokens=2, ignore_eos=True)
        forks.join()
        again = s.fork(2)
        again += lambda i: f"[{i}]"
        again.join("concate_and_append")

    state = both.run(backend=local, temperature=0)
    assert isinstance(state["word"], list) and len(state["word"]) == 3
    metas = state.get_meta_info("word")
    assert [m["completion_tokens"] for m in metas] == [2, 2, 2]
    assert state.text() == "hello world, [0][1]"


# ---- run_batch ------------------------------------------------------------------------------------------

@lang.function
def qa(s, topic):
    s += "Topic: " + topic + "\nNotes: " + lang.gen("notes", max_tokens=6, ignore_eos=True)
    s += "\nVerdict: " + lang.select("verdict", choices=["good", "bad"])


def test_run_batch_of_16_programs_equals_their_solo_runs(tiny_llama):
    topics = [f"{w} number {i}" for i, w in enumerate(["fox", "dog", "radix tree", "pool"] * 4)]
    engine = make_engine(tiny_llama)
    with lang.LocalBackend(engine) as backend:
        states = qa.run_batch([{"topic": t} for t in topics], backend=backend, temperature=0, progress_bar=True)
        batched = backend.loop.stats()
        solo = [qa.run(topic=t, backend=backend, temperature=0) for t in topics[:4]]
    assert len(states) == 16 and all(s.error() is None for s in states)
    assert [s.text() for s in states[:4]] == [s.text() for s in solo]
    assert all(s.text().startswith(f"Topic: {t}\nNotes: ") for s, t in zip(states, topics))
    # The 16 programs' gens shared decode steps. How many share one depends on how the program threads
    # (run_batch's pool) interleave with the loop: 1.82 was measured under a loaded CI run; 1.0 is none shared.
    assert batched["decode_batch_factor"] > 1.3


def test_run_batch_keeps_a_failure_on_its_state(local):
    @lang.function
    def maybe(s, bad):
        s += "x " + lang.gen("g", max_tokens=2, top_p=2.0 if bad else 1.0)

    states = maybe.run_batch([{"bad": False}, {"bad": True}, (False,)], backend=local, temperature=0)
    assert states[0].error() is None and states[2].error() is None
    assert isinstance(states[1].error(), lang.LangError) and "top_p" in str(states[1].error())
    with pytest.raises(lang.LangError, match="top_p"):
        states[1]["g"]


def test_sglangs_other_names_and_defaults(local):
    """What SGLang's frontend also exports and takes: gen_int, gen_string, select's temperature (0 only, as its
    server backend asserts), run_batch(num_threads="auto"); a block's message content is left-stripped."""
    @lang.function
    def named(s):
        s += "n: " + lang.gen_int("n", max_tokens=4) + " w: " + lang.gen_string("w", max_tokens=3)
        s += " pick: " + lang.select("pick", ["fox", "dog"], 0.0)
        with s.user():
            s += "  spaced"

    states = named.run_batch([{}, {}], backend=local, temperature=0, num_threads="auto")
    assert all(s.error() is None for s in states) and states[0].text() == states[1].text()
    assert re.fullmatch(r"[-+]?[0-9]+", states[0]["n"]) and states[0]["pick"] in ("fox", "dog")
    assert states[0].messages()[-1] == {"role": "user", "content": "spaced"}
    with pytest.raises(lang.LangError, match="temperature must be 0"):
        lang.select("pick", ["fox", "dog"], 0.7)
    for bad in (0, "many", 2.5):
        with pytest.raises(ValueError, match="num_threads"):
            named.run_batch([{}], backend=local, num_threads=bad)


# ---- constraints ----------------------------------------------------------------------------------------

def test_regex_choices_dtype_and_schema_inside_gen(local):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}

    @lang.function
    def constrained(s):
        s += "code: " + lang.gen("code", max_tokens=12, regex=r"[0-9]{3}-[a-z]{2}") + "\n"
        s += "animal: " + lang.gen("animal", choices=["fox", "dog", "radix tree"]) + "\n"
        s += "count: " + lang.gen("count", max_tokens=6, dtype=int) + "\n"
        s += "flag: " + lang.gen("flag", max_tokens=4, dtype=bool) + "\n"
        s += "json: " + lang.gen("obj", max_tokens=40, json_schema=schema)

    state = constrained.run(backend=local, temperature=0)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", state["code"])
    assert state["animal"] in ("fox", "dog", "radix tree")
    assert state.get_meta_info("animal")["normalized_prompt_logprobs"]  # choices in gen is a select
    assert re.fullmatch(r"[-+]?[0-9]+", state["count"])
    assert state["flag"] in ("True", "False")
    obj = json.loads(state["obj"])
    assert set(obj) == {"n", "ok"} and isinstance(obj["n"], int) and isinstance(obj["ok"], bool)


# ---- chat roles -----------------------------------------------------------------------------------------

def test_role_blocks_render_the_models_chat_template(local):
    @lang.function
    def chat(s):
        s += lang.system("You answer briefly.")
        with s.user():
            s += "What does the fox do?"
        s += lang.assistant(lang.gen("reply", max_tokens=6))
        s += lang.user_begin() + "And the dog?" + lang.user_end()
        s += lang.assistant_begin() + lang.gen("second", max_tokens=4) + lang.assistant_end()

    state = chat.run(backend=local, temperature=0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["reply"] and messages[1]["content"] == "What does the fox do?"
    assert state.text() == local.engine.apply_chat_template(messages, add_generation_prompt=False)
    assert "<|im_start|>assistant\n" + state["reply"] + "<|im_end|>" in state.text()


def test_a_templates_default_system_prompt_comes_with_the_first_block(tiny_llama):
    from generation.tokenizer import TextTokenizer

    engine = make_engine(tiny_llama)
    smol_like = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\n"
                 "You are a helpful assistant.<|im_end|>\n{% endif %}" + CHAT_TEMPLATE.split("%}", 1)[1])
    engine.tokenizer = TextTokenizer(engine.tokenizer.tok, chat_template=smol_like, bos_token="<|im_start|>",
                                     eos_token="<|im_end|>")

    @lang.function
    def chat(s):
        s += lang.user("hi") + lang.assistant("hello")

    with lang.LocalBackend(engine) as backend:
        state = chat.run(backend=backend)
    assert state.text().startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi")
    assert state.text() == engine.apply_chat_template(state.messages(), add_generation_prompt=False)


# ---- streaming ------------------------------------------------------------------------------------------

def test_streaming_yields_the_text_as_it_is_written(local, monkeypatch):
    """The writer waits (up to 10 s) for the reader to take each piece, so a reader that the scheduler leaves
    behind on a busy machine still sees pieces, not the whole text at once: how many arrive is then the
    program's doing, not the machine's."""
    @lang.function
    def story(s):
        s += "Once: " + lang.gen("first", max_tokens=8, ignore_eos=True)
        s += "\nThen: " + lang.gen("second", max_tokens=8, ignore_eos=True)

    taken, paced = threading.Semaphore(0), {"name": "*"}
    append = ProgramState._append

    def append_then_wait(self, piece, name=None):
        append(self, piece, name)
        if piece and (paced["name"] == "*" or name == paced["name"]):
            taken.acquire(timeout=10)

    def read(pieces):
        for piece in pieces:
            taken.release()
            yield piece

    whole = story.run(backend=local, temperature=0)
    monkeypatch.setattr(ProgramState, "_append", append_then_wait)
    state = story.run(backend=local, temperature=0, stream=True)
    pieces = list(read(state.text_iter()))
    assert "".join(pieces) == whole.text() == state.text() and len(pieces) > 4
    paced["name"] = "first"
    again = story.run(backend=local, temperature=0, stream=True)
    first = list(read(again.text_iter("first")))
    assert "".join(first) == whole["first"] and len(first) > 1
    assert state.error() is None


# ---- errors ---------------------------------------------------------------------------------------------

def test_errors_name_the_program_line(local):
    @lang.function
    def typo(s):
        s += "hello " + lang.gen("answer", max_tokens=2)
        s += s["answr"]  # the program's own line

    with pytest.raises(lang.UnknownVariable) as caught:
        typo.run(backend=local, temperature=0)
    message = str(caught.value)
    assert "s['answr'] at test_lang.py:" in message and 's += s["answr"]' in message and "'answer'" in message
    assert isinstance(caught.value, KeyError)

    with pytest.raises(lang.LangError, match=r"select\('pick'\) at test_lang.py:\d+ .*needs choices"):
        lang.select("pick")
    with pytest.raises(lang.LangError, match="needs choices"):
        lang.select("pick", choices=[])
    with pytest.raises(lang.LangError, match="regex and dtype"):
        lang.gen("x", regex="[0-9]+", dtype=int)

    @lang.function
    def unsatisfiable(s):
        s += "n: " + lang.gen("n", max_tokens=4, json_schema={"type": "array", "uniqueItems": True})

    with pytest.raises(lang.LangError) as caught:
        unsatisfiable.run(backend=local)
    assert "gen('n') at test_lang.py:" in str(caught.value) and "constraint.json_schema: unsupported keyword 'uniqueItems'" in str(caught.value)
    assert "uniqueItems" in str(caught.value)

    @lang.function
    def bad_params(s):
        s += "x" + lang.gen("x", max_tokens=2, top_p=0)

    with pytest.raises(lang.LangError, match=r"gen\('x'\) at test_lang.py:\d+ .*top_p"):
        bad_params.run(backend=local)

    @lang.function
    def nested(s):
        with s.user():
            s += lang.assistant("no")

    with pytest.raises(lang.LangError, match=r"assistant\(\) at test_lang.py:\d+ .*do not nest"):
        nested.run(backend=local)

    @lang.function
    def appends_none(s):
        s += None

    with pytest.raises(lang.LangError, match="cannot append None"):
        appends_none.run(backend=local)


def test_later_calls_stop_after_a_failure(local):
    @lang.function
    def failing(s):
        s += "a" + lang.gen("bad", max_tokens=2, temperature=-1)
        s += "b" + lang.gen("never", max_tokens=2)

    state = failing.run_batch([{}], backend=local)[0]
    assert "temperature" in str(state.error()) and "never" not in state
    assert state.text() == "a"


def test_program_arguments_and_sampling_defaults(local):
    @lang.function
    def greet(s, name, temperature="warm"):
        s += f"{name} is {temperature}: " + lang.gen("g", ignore_eos=True)

    state = greet.run("fox", backend=local, max_new_tokens=2, seed=3)  # temperature is the program's
    assert state.text().startswith("fox is warm: ") and state.get_meta_info("g")["completion_tokens"] == 2
    assert greet.bind(name="dog").run(backend=local, temperature=0.5, max_new_tokens=1).text().startswith("dog is 0.5")
    with pytest.raises(TypeError):
        greet.run(backend=local, nonsense=1)
