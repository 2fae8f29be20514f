"""The facade's agent-rollout methods (issue 13): sessions, scoring, tool-call parsing, LoRA.

A mixin of :class:`~rlinfer_core.engine.AsyncEngine`; the logic lives in
:mod:`rlinfer_core.session`, :mod:`rlinfer_core.scoring`, :mod:`rlinfer_core.agent` and
:mod:`rlinfer_core.lora`, and everything here is built on the facade's own ``generate`` or on the
optional hooks of :mod:`rlinfer_core.hookspecs` (``rlinfer_parse_tool_calls``, ``rlinfer_*_lora``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlinfer_core.engine import AsyncEngine
    from rlinfer_core.lora import LoraAdapter, LoraInfo
    from rlinfer_core.scoring import Score, ScoreRequest
    from rlinfer_core.session import AsyncSession
    from rlinfer_core.tool_loop import ToolLoopConfig
    from rlinfer_core.tool_runner import Prompt, SamplingPolicy, ToolEpisode
    from rlinfer_core.tools import ToolCalls
    from rlinfer_core.types import SamplingParams


class EngineAgent:
    """Sessions, scoring, tool calls and LoRA on an AsyncEngine."""

    def _self(self) -> AsyncEngine:
        return self  # type: ignore[return-value]  # always mixed into AsyncEngine

    def session(
        self,
        messages: Sequence[Mapping[str, Any]] | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        tools: Any = None,
        tool_parser: str | None = None,
        sampling: SamplingParams | None = None,
        chat_template: bool = True,
        strict: bool = True,
        lora: str | None = None,
    ) -> AsyncSession:
        """Open a multi-turn session (capability ``sessions``; see :mod:`rlinfer_core.session`).

        ``messages`` start a chat session rendered with the model's chat template (``tools``
        fill its tool section); ``chat_template=False`` with ``prompt_token_ids`` starts a raw
        token session. ``tool_parser`` parses every model turn's tool calls; ``sampling`` is the
        default for model turns; ``strict`` raises TemplateContinuityError where the template is
        not incremental (otherwise the turn is flagged ``exact=False``).
        """
        from rlinfer_core.session import AsyncSession

        engine = self._self()
        engine._ensure_open()
        return AsyncSession(
            engine,
            messages=messages,
            prompt_token_ids=prompt_token_ids,
            tools=tools,
            tool_parser=tool_parser,
            sampling=sampling,
            chat_template=chat_template,
            strict=strict,
            lora=lora,
        )

    async def score(self, requests: ScoreRequest | Sequence[ScoreRequest]) -> list[Score]:
        """Teacher-forced logprobs of given tokens under the current weights (capability
        ``score``, raw mode; see :mod:`rlinfer_core.scoring`)."""
        from rlinfer_core.scoring import score

        return await score(self._self(), requests)

    async def parse_tool_calls(self, text: str, parser: str, tools: Any = None) -> ToolCalls:
        """Tool calls in ``text`` by the engine's own ``parser`` (capability ``generate.tools``)."""
        from rlinfer_core.agent import parse_tool_calls

        return await parse_tool_calls(self._self(), text, parser, tools)

    async def run_tool_loop(
        self,
        prompts: Sequence[Prompt],
        config: ToolLoopConfig,
        sampling: SamplingParams | SamplingPolicy | None = None,
    ) -> list[ToolEpisode]:
        """The multi-turn tool loop over a batch of prompts, one session each, concurrently
        (capability ``sessions``; ``generate.tools`` when ``config`` has tools). Returns per prompt
        the session's result and the tool events; see :mod:`rlinfer_core.tool_runner`."""
        from rlinfer_core.tool_runner import run_tool_loop

        return await run_tool_loop(self._self(), prompts, config, sampling)

    async def load_lora(self, adapter: LoraAdapter) -> LoraInfo:
        """Load a LoRA adapter (capability ``lora``); requests use it with ``lora=adapter.name``."""
        from rlinfer_core.lora import registry

        return await registry(self._self()).load(adapter)

    async def update_lora(self, adapter: LoraAdapter) -> LoraInfo:
        """Replace a loaded adapter's weights in place (same name, rank and target modules)."""
        from rlinfer_core.lora import registry

        return await registry(self._self()).update(adapter)

    async def unload_lora(self, name: str) -> None:
        """Unload adapter ``name``."""
        from rlinfer_core.lora import registry

        await registry(self._self()).unload(name)

    async def list_loras(self) -> list[LoraInfo]:
        """The loaded adapters."""
        from rlinfer_core.lora import registry

        return await registry(self._self()).list()
