"""The multi-turn tool loop over a batch of prompts (``engine.run_tool_loop``).

One :class:`~rlinfer_core.session.AsyncSession` per prompt, all concurrently: generate a model
turn, parse its tool calls with the engine's parser, run the tools (concurrently, each within
``tool_timeout_s``), add their results as tool messages, and generate again, until a turn has no
call or a limit of :class:`~rlinfer_core.tool_loop.ToolLoopConfig` is reached. Each episode is the
session's :class:`~rlinfer_core.session.SessionResult` (token ids, loss mask, logprobs, weight
versions) plus one :class:`ToolEvent` per call.

A tool that raises, hangs past its timeout, or is called malformed never stops the batch: the
error text goes back to the model as the tool's result and the event records it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs

from rlinfer_core.chat_template import TemplateContinuityError
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.session import SessionResult
from rlinfer_core.tool_loop import ToolLoopConfig
from rlinfer_core.tools import ToolCall
from rlinfer_core.types import SamplingParams

if TYPE_CHECKING:
    from rlinfer_core.engine import AsyncEngine

logger = logging.getLogger(__name__)

#: why an episode ended
StopReason = Literal["no_tool_call", "max_assistant_turns", "max_tool_rounds", "error"]
#: a prompt: chat messages, or one user message's text
Prompt = Sequence[Mapping[str, Any]] | str
#: sampling of a model turn: one SamplingParams for all, or (episode index, turn index) -> params
SamplingPolicy = Callable[[int, int], SamplingParams]


@attrs.frozen
class ToolEvent:
    """One tool call of an episode and what came of it."""

    turn: int  #: index of the model turn (0-based, model turns only) that made the call
    name: str | None
    arguments: Mapping[str, Any] | None = attrs.field(eq=False)
    call_id: str | None
    #: the text given back to the model as the tool message (the error text for a failed call)
    result: str
    error: str | None = None  #: why the call failed: malformed, unknown tool, raised, timed out
    seconds: float = 0.0
    reward: float | None = None  #: a verl-style tool's step reward
    metrics: Mapping[str, Any] = attrs.field(factory=dict, eq=False)

    @property
    def ok(self) -> bool:
        """True when the tool ran and returned."""
        return self.error is None


@attrs.frozen
class ToolEpisode:
    """One prompt's episode: the trainer-ready session result and the tool events."""

    index: int  #: the prompt's position in the batch
    result: SessionResult
    events: tuple[ToolEvent, ...]
    assistant_turns: int
    stop: StopReason
    error: str | None = None  #: why the session could not go on (stop == "error")

    @property
    def tool_reward(self) -> float:
        """The sum of the verl-style tools' step rewards."""
        return sum(e.reward or 0.0 for e in self.events)


class _EpisodeTools:
    """The batch's tool objects as one episode sees them: verl-style tools get one instance id
    per episode (``create`` on first use, ``release`` at the end)."""

    def __init__(self, tools: Mapping[str, Any], config: ToolLoopConfig, limit: asyncio.Semaphore) -> None:
        self.tools = tools
        self.config = config
        self.limit = limit
        self.instances: dict[str, str] = {}

    async def call(self, turn: int, call: ToolCall) -> ToolEvent:
        """Run one parsed call; every failure becomes an event with ``error`` set."""
        arguments = dict(call.arguments or {}) if call.ok else None
        started = time.perf_counter()
        name = call.name
        if not call.ok or name is None or name not in self.tools:
            error = call.error or f"unknown tool {name!r}"
            return self._event(turn, call, arguments, None, error, started)
        async with self.limit:
            started = time.perf_counter()
            try:
                response, reward, metrics = await asyncio.wait_for(
                    self._invoke(name, arguments or {}), timeout=self.config.tool_timeout_s
                )
            except TimeoutError:
                error = f"tool {call.name!r} timed out after {self.config.tool_timeout_s:g} s"
                return self._event(turn, call, arguments, None, error, started)
            except Exception as exc:  # a tool's failure is the episode's, never the batch's
                error = f"tool {call.name!r} raised {type(exc).__name__}: {exc}"
                return self._event(turn, call, arguments, None, error, started)
        event = self._event(turn, call, arguments, _text(response), None, started)
        return attrs.evolve(event, reward=reward, metrics=dict(metrics or {}))

    def _event(
        self, turn: int, call: ToolCall, arguments: Any, text: str | None, error: str | None, started: float
    ) -> ToolEvent:
        result = self.config.truncate(f"error: {error}" if error is not None else text or "")
        seconds = time.perf_counter() - started
        return ToolEvent(turn, call.name, arguments, call.id, result, error, seconds)

    async def _invoke(self, name: str, arguments: dict[str, Any]) -> tuple[Any, float | None, Any]:
        tool = self.tools[name]
        execute = getattr(tool, "execute", None)
        if callable(execute):
            if name not in self.instances:
                create = getattr(tool, "create", None)
                created = await create() if callable(create) else str(uuid.uuid4())
                # newer verl tools return (instance_id, ToolResponse)
                self.instances[name] = created[0] if isinstance(created, tuple) else created
            out = await execute(self.instances[name], arguments)
            if isinstance(out, tuple) and len(out) == 3:
                return out[0], None if out[1] is None else float(out[1]), out[2]
            return out, None, None
        if inspect.iscoroutinefunction(tool) or inspect.iscoroutinefunction(type(tool).__call__):
            return await tool(arguments), None, None
        out = await asyncio.to_thread(tool, arguments)  # a blocking tool must not stall the loop
        return (await out if inspect.isawaitable(out) else out), None, None

    async def release(self) -> None:
        """Release the verl-style instances this episode created (failures are logged)."""
        for name, instance in self.instances.items():
            release = getattr(self.tools[name], "release", None)
            if not callable(release):
                continue
            try:
                await asyncio.wait_for(release(instance), timeout=self.config.tool_timeout_s)
            except Exception as exc:
                logger.warning("releasing tool %r instance %s failed: %s", name, instance, exc)


def _text(response: Any) -> str:
    """A tool's response as text: a string, a mapping's or object's ``text``, else JSON."""
    if isinstance(response, str):
        return response
    if response is None:
        return ""
    if isinstance(response, Mapping) and isinstance(response.get("text"), str):
        return str(response["text"])
    text = getattr(response, "text", None)
    if isinstance(text, str):
        return text
    try:
        return json.dumps(response)
    except (TypeError, ValueError):
        return str(response)


def _messages(prompt: Prompt, index: int) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = [m for m in prompt if isinstance(m, Mapping)] if isinstance(prompt, Sequence) else []
    if not messages or len(messages) != len(prompt):
        raise InvalidRequest(f"prompts[{index}]", f"must be a list of chat messages or a string, got {prompt!r}")
    return [dict(m) for m in messages]


async def _episode(
    engine: AsyncEngine,
    index: int,
    prompt: list[dict[str, Any]],
    config: ToolLoopConfig,
    tools: _EpisodeTools,
    sampling: SamplingPolicy,
) -> ToolEpisode:
    specs = config.specs
    session = engine.session(
        prompt,
        tools=list(specs) if specs else None,
        tool_parser=config.tool_parser if specs else None,
        strict=config.strict,
    )
    events: list[ToolEvent] = []
    turns = rounds = 0
    stop: StopReason = "no_tool_call"
    error: str | None = None
    try:
        while True:
            try:
                turn = await session.generate(sampling(index, turns))
            except (InvalidRequest, TemplateContinuityError) as exc:  # e.g. the context is full
                stop, error = "error", str(exc)
                break
            turns += 1
            calls = turn.tool_calls.calls if turn.tool_calls else ()
            if not calls:
                break
            if turns >= config.max_assistant_turns:
                stop = "max_assistant_turns"
                break
            most = config.max_parallel_calls
            ran = await asyncio.gather(*(tools.call(turns - 1, c) for c in calls[:most]))
            skipped = [
                ToolEvent(turns - 1, c.name, c.arguments, c.id, "", f"not run: more than max_parallel_calls={most}")
                for c in calls[most:]
            ]
            events.extend([*ran, *skipped])
            try:
                for event in ran:
                    session.add_tool_result(event.result, name=event.name, tool_call_id=event.call_id)
            except (InvalidRequest, TemplateContinuityError) as exc:
                stop, error = "error", str(exc)
                break
            rounds += 1
            if config.max_tool_rounds is not None and rounds >= config.max_tool_rounds:
                stop = "max_tool_rounds"
                break
    finally:
        await tools.release()
    return ToolEpisode(index, session.result(), tuple(events), turns, stop, error)


async def run_tool_loop(
    engine: AsyncEngine,
    prompts: Sequence[Prompt],
    config: ToolLoopConfig,
    sampling: SamplingParams | SamplingPolicy | None = None,
) -> list[ToolEpisode]:
    """Run the tool loop for every prompt concurrently (see the module docstring); episodes in
    prompt order. ``sampling``: one SamplingParams for every model turn, or a function of (episode
    index, model turn index) giving each turn's (e.g. a structured-output bootstrap of the call
    format); default: the engine's ``default_sampling`` with ``n=1`` (a session holds one
    trajectory: repeat a prompt for a group). Tool classes named by path are built once per call.
    Engine errors other than a refused turn (the episode stops with ``stop="error"``) propagate."""
    policy: SamplingPolicy
    if sampling is None:
        default = engine.config.sampling(n=1)
        policy = lambda _episode, _turn: default  # noqa: E731
    elif isinstance(sampling, SamplingParams):
        fixed = sampling
        policy = lambda _episode, _turn: fixed  # noqa: E731
    elif callable(sampling):
        policy = sampling
    else:
        raise InvalidRequest("sampling", f"must be SamplingParams or a function (episode, turn), got {sampling!r}")
    messages = [_messages(p, i) for i, p in enumerate(prompts)]
    built = {d.spec.name: d.build() for d in config.tools}
    limit = asyncio.Semaphore(config.max_concurrent_tools)
    return list(
        await asyncio.gather(
            *(
                _episode(engine, i, m, config, _EpisodeTools(built, config, limit), policy)
                for i, m in enumerate(messages)
            )
        )
    )
