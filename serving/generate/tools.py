"""OpenAI function calling: `tools`, `tool_choice`, and the `tool_calls` read back from the output.

A call the client forces is constrained decoding, whatever the model was trained on (vLLM does the same):
a named function holds the output to that tool's `parameters` schema, and `"required"` to a JSON list of
`{"name", "parameters"}` objects over all the tools, so the answer always parses into `tool_calls` with
arguments that validate. `"none"` answers in text.

What the model *chooses* (`"auto"`, OpenAI's default once tools are given) would need a parser for the model's
own tool-call syntax, which SmolLM2's chat template does not have. So the choice is made inside one constrained
JSON answer instead, which parses on any model: `{"tool_calls": [<call>, ...]}`, each call the object
`"required"` writes, or `{"response": "<text>"}`. The model is told the tools and that format by a system
instruction (`AUTO_INSTRUCTION`, joined to the first system message or put before the conversation), and an
earlier assistant's calls are shown to it as the JSON it would have written. The tools do not reach the chat
template under auto: a template that renders them would teach its own call format, which the constraint then
forbids. The answer is read by `tool_reply.py`: calls are `tool_calls` with `finish_reason: "tool_calls"` (as
OpenAI and vLLM send when the model chose to call), a reply is the message's text, decoded.

Streamed, a forced call comes as it is generated: a named call's arguments token by token, and each call of a
`"required"` list (read as it grows by `call_list.py`) with its id and name once its name has closed, then its
arguments; auto's calls come the same way once its first key shows, its reply as text deltas. A call's
`arguments` are the text the model wrote for them, streamed or not, so a stream's fragments add up to the whole
answer's byte for byte, as a reply's deltas add up to its content. A list cut short (by `max_tokens`) does not
parse: the whole answer gives its text as `content`, no `tool_calls`, finish `length`; a stream cannot take back
the calls it has sent, so it sends that same text as `content` before the same finish: what the whole answer
says is in it too. A reply cut short is its text so far, as any text answer cut short.

Except under auto, the tools reach the chat template (`tools`, as transformers passes them), so a model whose
template renders them sees them; SmolLM2's does not, so what the model must know belongs in the messages too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from string import Template
from typing import Any

from generation.constraints import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_ONE
from serving.generate import tool_reply
from serving.generate.body import BodyConstraint, Fields, bad
from serving.generate.call_list import CallList
from serving.generate.config import GenerateConfig

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function name
# OpenAI: a function without `parameters` takes none, so its arguments are exactly {}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
CHOICES = ("none", "auto", "required")
# What the model is told under auto ($tools: one JSON line per tool). SmolLM2-135M, greedy, replies to "Write a
# haiku about the sea." and calls get_weather for "Is it raining in Tokyo right now?" with it (docs/serving.md).
AUTO_INSTRUCTION = ("You can call these tools, one JSON object per line:\n$tools\n\n"
                    'Answer with one JSON object: {"tool_calls": [{"name": ..., "parameters": {...}}]} to call tools, '
                    'or {"response": "..."} to answer the user directly.')


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any]
    index: int  # its place in `tools`
    where: str  # the body field of its function: `tools[i].function` (chat) or `tools[i]` (Responses)
    description: str | None = None

    @property
    def field(self) -> str:
        return f"{self.where}.parameters"


class ToolsConstraint(BodyConstraint):
    """`"required"`'s list of calls, or `"auto"`'s choice between such a list and a reply. Each tool's schema is
    compiled alone first (`parts`), so an error in one names that tool's field and its own paths, and a tool no
    output can satisfy is refused rather than silently never called; what is left is the whole's."""

    def __init__(self, spec: dict[str, Any], tools: list[Tool]) -> None:
        super().__init__("json_schema", spec, "tools")
        self.tools = tools

    def parts(self) -> list[BodyConstraint]:
        return [BodyConstraint("json_schema", t.parameters, t.field) for t in self.tools]


@dataclass
class ToolCalling:
    """A chat request's tools and what it asks of them. `forced` is the named function; `required` any
    call (`parallel`: one or more, else exactly one); `auto` the model's choice between calls and a reply, in one
    JSON answer; none of them: answer in text (`tool_choice: "none"`)."""

    tools: list[Tool]
    definitions: list[dict[str, Any]]  # as the body gave them, in chat's spelling: what the chat template sees
    forced: Tool | None = None
    required: bool = False
    parallel: bool = True
    auto: bool = False

    @property
    def calls_forced(self) -> bool:
        return self.forced is not None or self.required

    @property
    def constrained(self) -> bool:
        """The answer is JSON that the tools' constraint holds: a forced call, or auto's calls or reply."""
        return self.calls_forced or self.auto

    def constraint(self) -> BodyConstraint | None:
        if self.forced is not None:
            return BodyConstraint("json_schema", self.forced.parameters, self.forced.field)
        if not self.constrained:
            return None
        defs: dict[str, Any] = {}
        call = [{"type": "object", "properties": {"name": {"const": t.name}, "parameters": _hoisted(t, defs)},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in self.tools]
        calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
        if not self.parallel:
            calls["maxItems"] = 1
        schema = calls if self.required else {"anyOf": [_one_key("tool_calls", calls),
                                                        _one_key("response", {"type": "string"})]}
        if defs:
            schema["$defs"] = defs
        return ToolsConstraint(schema, self.tools)

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The output as OpenAI `tool_calls`; None when it does not parse (a length cut, a failed choice) or, under
        auto, when the model replied instead."""
        if self.forced is not None:  # the arguments are the text itself, as generated (a cut one included)
            return [tool_call(self.forced.name, text)]
        if self.auto:
            found = tool_reply.read(text).calls
            return None if found is None else [tool_call(c.name or "", c.arguments) for c in found]
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        # each call's arguments as the model wrote them (compact, as OpenAI's and a forced call's are), which is
        # what a stream sends as they come; json.dumps of the parsed value would add spaces a stream never saw
        found = CallList()
        found.feed(text)
        return [tool_call(c.name or "", c.arguments) for c in found.calls]

    def content(self, text: str) -> str:
        """The answer as message text, where it has no calls: under auto the reply's text, decoded (or, for calls
        cut short, the text as written); otherwise the text itself."""
        return tool_reply.read(text).content if self.auto else text

    def finish_reason(self, called: bool, reason: str) -> str:
        """OpenAI's and vLLM's: `tool_calls` when the model chose to call (auto); a forced call keeps the engine's."""
        return "tool_calls" if self.auto and called else reason

    # ---- what the model is shown ------------------------------------------------------------------------

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template is given them: none under auto, whose own format the template's (a model
        trained on one) would contradict; the system instruction shows them instead."""
        return None if self.auto else self.definitions

    def shown(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
        """The conversation as the chat template renders it, and how many messages were put before the body's
        (0 or 1: a field the template names in an error is the body's index plus that). Under auto the system
        message gains `instruction()`, and an earlier assistant's calls read as the JSON it was asked to write."""
        if not self.auto:
            return messages, 0
        shown = [_as_written(m) for m in messages]
        if shown[0]["role"] == "system":
            shown[0] = {**shown[0], "content": _appended(shown[0]["content"], self.instruction())}
            return shown, 0
        return [{"role": "system", "content": self.instruction()}, *shown], 1

    def instruction(self) -> str:
        lines = [_compact({"name": t.name, **({"description": t.description} if t.description else {}),
                           "parameters": t.parameters}) for t in self.tools]
        return Template(AUTO_INSTRUCTION).substitute(tools="\n".join(lines))


def _one_key(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": False}


def _compact(value: Any) -> str:
    """JSON as the constraint makes the model write it: no spaces, characters as they are."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _as_written(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier calls as auto's answer would have written them, in place of its content (one
    answer is calls or a reply, never both); arguments that are not JSON go in as the string they are."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not calls:
        return message
    listed = []
    for c in calls:
        try:
            parameters = json.loads(c["function"]["arguments"])
        except json.JSONDecodeError:
            parameters = c["function"]["arguments"]
        listed.append({"name": c["function"]["name"], "parameters": parameters})
    return {**{k: v for k, v in message.items() if k != "tool_calls"}, "content": _compact({"tool_calls": listed})}


def _appended(content: Any, text: str) -> Any:
    """A system message's content with `text` after a blank line (text parts are joined with newlines); content of
    another type is left for the chat template to refuse, naming it."""
    if isinstance(content, str):
        return f"{content}\n\n{text}" if content else text
    if isinstance(content, list):
        return [*content, {"type": "text", "text": "\n" + text}]
    return content


def tools_constraint(calling: ToolCalling | None, stop: list[str], given: BodyConstraint | None,
                     given_name: str) -> BodyConstraint | None:
    """What the output is held to: the tools' constraint where they set one (a forced call, auto's calls or
    reply), else the body's own (`given`, from the field `given_name`). Beside the tools' JSON, a stop string
    (it would cut the JSON) and another format are refused by name."""
    if calling is None or not calling.constrained:
        return given
    if stop:
        raise bad("stop", "a forced call ends where its JSON does: a stop string would cut its arguments"
                  if calling.calls_forced else "with tools (tool_choice \"auto\", the default) the answer is one JSON "
                  "object, calls or a reply: a stop string would cut it; tool_choice \"none\" answers in plain text")
    if given is not None:
        raise bad("tool_choice", f"a forced call is held to its tool's parameters: give {given_name} or a forced "
                                 "tool_choice, not both" if calling.calls_forced else
                  f"\"auto\" (the default once tools are given) holds the answer to calls or a reply: give "
                  f"{given_name} with tool_choice \"none\", or tools without {given_name}")
    return calling.constraint()


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
        calling.auto = True
        return calling
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


def offered(given: Any, cfg: GenerateConfig) -> ToolCalling:
    """Chat's `tools` with no `tool_choice`: auto, as OpenAI's default (`/tokenize` renders them as chat does)."""
    return ToolCalling(tool_list(given, cfg), given, auto=True)


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
    return Tool(name, parameters, i, where, fn.raw("description"))
