"""Example tools for the tool loop (:mod:`rlinfer_core.tool_loop`).

``Calculator`` is the demo's ``calc`` tool (``rlinfer demo --task agent``) as a verl-style tool
class, so a verl tool config can name it::

    tools:
      - class_name: rlinfer_core.example_tools.Calculator
        config: {type: native}
        tool_schema: {type: function, function: {name: calc, ...}}   # or CALCULATOR_SCHEMA
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

#: the ``calc`` tool's schema (OpenAI function tool), as the demo's agent task uses it
CALCULATOR_SCHEMA: Mapping[str, Any] = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


class Calculator:
    """Adds two integers, with verl's tool interface: ``create`` an instance per episode,
    ``execute(instance_id, {"a": .., "b": ..})`` -> ``(str(a + b), 0.0, {"calls": n})``,
    ``release``. ``config`` may set ``offset`` (added to every sum; for tests)."""

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Any = None) -> None:
        self.config = dict(config or {})
        self.tool_schema = tool_schema if tool_schema is not None else CALCULATOR_SCHEMA
        self.offset = int(self.config.get("offset", 0))
        self.calls: dict[str, int] = {}  #: calls per live instance

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """A new instance id for one episode."""
        instance = instance_id or str(uuid.uuid4())
        self.calls[instance] = 0
        return instance

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[str, float, dict[str, Any]]:
        """``a + b`` as text; raises ValueError on arguments that are not integers."""
        a, b = parameters.get("a"), parameters.get("b")
        if not (isinstance(a, int) and isinstance(b, int)) or isinstance(a, bool) or isinstance(b, bool):
            raise ValueError(f"a and b must be integers, got {parameters!r}")
        self.calls[instance_id] = self.calls.get(instance_id, 0) + 1
        return str(a + b + self.offset), 0.0, {"calls": self.calls[instance_id]}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Forget the instance."""
        self.calls.pop(instance_id, None)
