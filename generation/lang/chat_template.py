"""Role blocks from the model's own chat template.

SGLang's frontend keeps a table of templates matched by model name. We render the model's jinja
template instead, so a role block writes exactly what `apply_chat_template` would for the same messages
(a template's default system prompt included): a block's prefix and suffix are what rendering the
history plus one message adds to the history alone, split where a sentinel content stands.
"""

from __future__ import annotations

from collections.abc import Callable

Render = Callable[[list[dict[str, str]]], str]
_SENTINEL = "\u27e6pagoda-role-content\u27e7"


class ChatTemplate:
    """`render(messages)` renders a conversation without a generation prompt."""

    def __init__(self, render: Render) -> None:
        self.render = render

    def wrap(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        """The text before and after a `role` message that follows `history`. ValueError when the template
        does not render the conversation incrementally (the history's text would change)."""
        before = self.render(history) if history else ""
        full = self.render([*history, {"role": role, "content": _SENTINEL}])
        if not full.startswith(before) or full.count(_SENTINEL) != 1:
            raise ValueError(f"the model's chat template does not render a {role!r} message after "
                             f"{len(history)} messages as an addition to them, so a role block cannot be applied")
        prefix, suffix = full[len(before):].split(_SENTINEL)
        return prefix, suffix
