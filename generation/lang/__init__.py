"""The frontend language: programs that interleave prompt text with `gen`, `select` and `fork`, in SGLang's
style, run on the engine in this process (`LocalBackend`) or against a `/generate` server (`HttpBackend`).

```python
from generation import lang

@lang.function
def answer(s, question):
    s += "Q: " + question + "\nA: " + lang.gen("answer", max_tokens=64, stop="\n")
    s += "\nConfident: " + lang.select("sure", choices=["yes", "no"])

state = answer.run(question="...", backend=lang.LocalBackend(engine), temperature=0)
state["answer"], state["sure"], state.text()
```

The names and defaults are SGLang's frontend's, so a program written for `sglang` runs here by changing
its import. docs/lang.md says how to write and run programs. Importing this package is cheap; the
backends load torch or requests when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from generation.lang.backend import Backend, set_default_backend
from generation.lang.choices import (
    ChoiceMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from generation.lang.errors import LangError, UnknownVariable
from generation.lang.ir import (
    assistant,
    assistant_begin,
    assistant_end,
    gen,
    gen_int,
    gen_string,
    select,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from generation.lang.program import Program, function
from generation.lang.state import ForkGroup, ProgramState

if TYPE_CHECKING:
    from generation.lang.backend_http import HttpBackend
    from generation.lang.backend_local import LocalBackend

_LAZY = {"LocalBackend": "generation.lang.backend_local", "HttpBackend": "generation.lang.backend_http"}

__all__ = ["function", "Program", "ProgramState", "ForkGroup", "gen", "gen_int", "gen_string", "select", "system", "user", "assistant",
           "system_begin", "system_end", "user_begin", "user_end", "assistant_begin", "assistant_end",
           "Backend", "LocalBackend", "HttpBackend", "set_default_backend", "ChoiceMethod", "token_length_normalized",
           "greedy_token_selection", "unconditional_likelihood_normalized", "LangError", "UnknownVariable"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
