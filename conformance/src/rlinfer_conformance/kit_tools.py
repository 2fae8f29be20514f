"""Tools that misbehave, for the kit's tool-loop test (named by dotted path in a verl tool config)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

#: what RaisingTool's error says (the test finds it in the tool message)
RAISED = "the kit's tool always fails"


class RaisingTool:
    """verl-style tool whose ``execute`` always raises."""

    def __init__(self, config: Mapping[str, Any] | None = None, tool_schema: Any = None) -> None:
        self.config = dict(config or {})
        self.tool_schema = tool_schema

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[str, float, dict[str, Any]]:
        """Raise."""
        raise RuntimeError(RAISED)


class HangingTool:
    """rlinfer-style tool (an async callable) that never returns."""

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    async def __call__(self, arguments: dict[str, Any]) -> str:
        """Sleep far past any tool timeout."""
        await asyncio.sleep(3600)
        return "never"
