"""OpenAI function calling: `tools`, `tool_choice`, and the `tool_calls` read back from the output.

A call the client forces is constrained decoding, whatever the model was trained on (vLLM does the same):
a named function holds the output to that tool's `parameters` schema, and `"required"` to a JSON list of
`{"name", "parameters"}` objects over all the tools, so the answer always parses into `tool_calls` with
arguments that validate. What the model *chooses* (`"auto"`, OpenAI's default once tools are given) needs a
parser for the model's own tool-call syntax, which SmolLM2's chat template does not have; it is refused by
name rather than answered as text a client would read as "no call was wanted". `"none"` answers in text.

Streamed, a forced call comes as it is generated: a named call's arguments token by token, and each call of a
`"required"` list (read as it grows by `call_list.py`) with its id and name once its name has closed, then its
arguments. A call's `arguments` are the text the model wrote for them, streamed or not, so a stream's fragments
add up to the whole answer's byte for byte. A list cut short (by `max_tokens`) does not parse: the whole answer
gives its text as `content`, no `tool_calls`, finish `length`; a stream cannot take back the calls it has sent,
so it sends that same text as `content` before the same finish: what the whole answer says is in it too.

The tools always reach the chat template (`tools`, as transformers passes them), so a model whose template
renders them sees them; SmolLM2's does not, so what the model must know belongs in the messages too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from generation.constraints import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_ONE
from serving.generate.body import BodyConstraint, Fields, bad
from serving.generate.call_list import CallList
from serving.generate.config import GenerateConfig

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name
# OpenAI: a function without `parameters` takes none, so its arguments are exactly {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    index: int  # its place in `tools`
    where: str  # the body field of its function: `tools[i].function` (chat) or `tools[i]` (Responses)

    @property
    def field(self) -> str:
        return f"{self.where}.parameters"


class RequiredConstraint(BodyConstraint):
    """`tool_choice: "required"`'s list of calls. Each tool's schema is compiled alone first (`parts`), so an
    error in one names that tool's field and its own paths, and a tool no output can satisfy is refused rather
    than silently never called; what is left is the whole list's."""

    def __init__(self, spec: dict[str, Any], tools: list[Tool]) -> None:
        super().__init__("json_schema", spec, "tools")
        self.tools = tools

    def parts(self) -> list[BodyConstraint]:
        return [BodyConstraint("json_schema", t.parameters, t.field) for t in self.tools]


@dataclass
class ToolCalling:
    """A chat request's tools and what it asks of them. `forced` is the named function; `required` any
    call (`parallel`: one or more, else exactly one); neither: answer in text (`tool_choice: "none"`)."""

    tools: list[Tool]
    definitions: list[dict[str, Any]]  # as the body gave them: what the chat template sees
    forced: Tool | None = None
    required: bool = False
    parallel: bool = True

    @property
    def calls_forced(self) -> bool:
        return self.forced is not None or self.required

    def constraint(self) -> BodyConstraint | None:
        if self.forced is not None:
            return BodyConstraint("json_schema", self.forced.parameters, self.forced.field)
        if not self.required:
            return None
        defs: dict[str, Any] = {}
        call = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": _hoisted(t, defs)},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return RequiredConstraint(schema, self.tools)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The output as OpenAI `tool_calls`; None when it does not parse (a length cut, a failed choice)."""
        if self.forced is not None:  # the arguments are the text itself, as generated (a cut one included)
            return [tool_call(self.forced.name, text)]
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        # each call's arguments as the model wrote them (compact, as OpenAI's and a forced call's are), which is
        # what a stream sends as they come; json.dumps of the parsed value would add spaces a stream never saw
        found = CallList()
        found.feed(text)
        return [tool_call(c.name or "", c.arguments) for c in found.calls]


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _hoisted(tool: Tool, defs: dict[str, Any]) -> dict[str, Any]:
    """Tool's schema as one branch of the list. A schema with `$ref`s (pydantic writes `#/$defs/...`) points
    into its own root, which inside the list is no longer the root: it moves into `$defs` under its own
    name and every local reference gains that prefix."""
    if '"$ref"' not in json.dumps(tool.parameters):
        return tool.parameters
    key = f"tool{tool.index}"

    def rewrite(schema: Any) -> Any:
        """Only where a schema stands: a `$ref` key inside `const`, `enum` or `default` is data, kept as given."""
        if not isinstance(schema, dict):
            return schema
        out = dict(schema)
        for k, v in schema.items():
            if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                out[k] = f"#/$defs/{key}{v[1:]}"
            elif k in SCHEMA_MAPS and isinstance(v, dict):
                out[k] = {name: rewrite(child) for name, child in v.items()}
            elif k in SCHEMA_LISTS and isinstance(v, list):
                out[k] = [rewrite(child) for child in v]
            elif k in SCHEMA_ONE:
                out[k] = rewrite(v)
        return out

    defs[key] = rewrite(tool.parameters)
    return {"$ref": f"#/$defs/{key}"}


def parse_tools(f: Fields, cfg: GenerateConfig, flat: bool = False) -> ToolCalling | None:
    """The body's `tools`, `tool_choice` and `parallel_tool_calls`, each error naming its field. `flat`: the
    Responses API's spelling, where a tool's name and parameters sit beside its `type` (chat nests them under
    `function`), and so does a named `tool_choice`'s name."""
    choice = f.raw("tool_choice")
    if not f.has("tools"):
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs tools: give the functions in `tools`")
        if f.has("parallel_tool_calls"):
            f.boolean("parallel_tool_calls")
        return None
    given = f.raw("tools")
    tools = tool_list(given, cfg, flat)
    names = [t.name for t in tools]
    if flat:  # the chat template reads chat's spelling, as transformers passes it
        given = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in given]
    calling = ToolCalling(tools, given, parallel=f.boolean("parallel_tool_calls", True))
    if choice is None or choice == "auto":
        named = '{"type": "function", "name": ...}' if flat else '{"type": "function", "function": {"name": ...}}'
        raise bad("tool_choice", "\"auto\" is not supported: this model has no tool-call syntax to parse. Force a "
                                 f"call with \"required\" or {named}, or answer in text with \"none\"")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise bad("tool_choice", f"must be one of {', '.join(CHOICES)} or a named function, got {choice!r}")
        calling.required = choice == "required"
        return calling
    if isinstance(choice, dict) and choice.get("type") != "function":  # before its other fields: `allowed_tools`, ...
        raise bad("tool_choice.type", f"must be \"function\", got {choice.get('type')!r:.40}")
    named = Fields(choice, {"type", "name"} if flat else {"type", "function"}, "tool_choice.", "tool_choice")
    function = named if flat else Fields(named.raw("function"), {"name"}, "tool_choice.function.", "tool_choice.function")
    name = function.raw("name")
    if name not in names:
        raise bad(function.where("name"), f"{name!r} is not one of the tools ({', '.join(names)})")
    calling.forced = tools[names.index(name)]
    return calling


def tool_list(given: Any, cfg: GenerateConfig, flat: bool = False) -> list[Tool]:
    """A body's `tools`, each checked (`/tokenize` reads them too, to render the chat template as chat does)."""
    if not isinstance(given, list) or not given:
        raise bad("tools", "must be a non-empty list of tools")
    if len(given) > cfg.max_tools:
        raise bad("tools", f"at most {cfg.max_tools} tools (--generate-max-tools), got {len(given)}")
    tools = [_tool(t, i, flat) for i, t in enumerate(given)]
    names = [t.name for t in tools]
    twice = next((i for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise bad(f"{tools[twice].where}.name", f"{names[twice]!r} is defined twice")
    return tools


FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}


def _tool(value: Any, i: int, flat: bool) -> Tool:
    where = f"tools[{i}]"
    tool = Fields(value, {"type", *FUNCTION_FIELDS} if flat else {"type", "function"}, f"{where}.", "a tool")
    if tool.raw("type") != "function":
        raise bad(f"{where}.type", f"must be \"function\", got {tool.raw('type')!r}"
                  + (" (this server runs no hosted tools)" if flat else ""))
    if not flat:
        where += ".function"
    fn = tool if flat else Fields(tool.raw("function"), FUNCTION_FIELDS, f"{where}.", "a function")
    name = fn.raw("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad(f"{where}.name", f"must be 1-64 letters, digits, _ or -, got {name!r}")
    if fn.has("description") and not isinstance(fn.raw("description"), str):
        raise bad(f"{where}.description", "must be a string")
    fn.boolean("strict")  # the arguments of a forced call always follow the schema, strict or not
    parameters = fn.raw("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict):
        raise bad(f"{where}.parameters", "must be a JSON schema object")
    if not parameters:  # {} takes none, as no parameters do
        parameters = NO_PARAMETERS
    if "type" not in parameters and "$ref" not in parameters:  # arguments are a JSON object: a schema of
        parameters = {**parameters, "type": "object"}  # properties alone would also take a string or a number
    if parameters.get("type", "object") != "object":
        raise bad(f"{where}.parameters.type", f"must be \"object\", got {parameters['type']!r}")
    return Tool(name, parameters, i, where)
