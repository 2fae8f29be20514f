"""``tools`` / ``tool_choice`` of a chat request, and the assistant message of an answer.

The rules are vLLM's (its chat server is the reference):

* ``tool_choice`` defaults to ``"auto"`` when ``tools`` are given, ``"none"`` otherwise; a
  ``tool_choice`` other than ``"none"`` needs ``tools``; a named function must be one of them.
* ``"none"``: the tools are rendered in the template; the answer is plain content.
* ``"auto"``: with the server's ``--tool-call-parser``, the engine's own parser reads the output
  (``GenerateRequest.tool_parser``) and well-formed calls become ``message.tool_calls`` with
  ``finish_reason: "tool_calls"``; without a parser the answer is plain content (as vLLM without
  ``--enable-auto-tool-choice``).
* ``"required"``: the output is constrained to a JSON array of ``{"name", "parameters"}`` objects
  (one of the tools each, no other keys; at most one with ``parallel_tool_calls: false``), read
  back as calls.
* a named function: the output is constrained to that function's parameters schema and is the
  call's ``arguments``.

Calls the parser found but that are malformed (unreadable, an unknown tool, arguments that break
the schema) are not returned as ``tool_calls``; they are listed in the choice's
``tool_call_errors`` extension (``raw`` text and ``error``).
"""

from __future__ import annotations

import copy
import enum
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.structured import StructuredOutput
from rlinfer_core.tools import ToolCalls, ToolSpec, to_tools
from rlinfer_server.schemas import ChatRequest, NamedToolChoice


class ToolMode(enum.StrEnum):
    """What the request's ``tool_choice`` asks for."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@attrs.frozen
class ToolPlan:
    """How a chat request uses its tools: the validated specs (rendered by the template), the
    mode, the engine parser that reads ``auto`` answers, and the constraint of ``required`` /
    named answers."""

    specs: tuple[ToolSpec, ...] | None = None
    mode: ToolMode = ToolMode.NONE
    parser: str | None = None
    function: str | None = None
    constraint: StructuredOutput | None = None
    parallel: bool = True

    @property
    def reads_calls(self) -> bool:
        """True when answers are read as tool calls (content is held back while streaming)."""
        return self.parser is not None or self.mode in (ToolMode.REQUIRED, ToolMode.NAMED)


def _parameters(spec: ToolSpec) -> dict[str, Any]:
    if not spec.parameters:
        return {"type": "object", "properties": {}}
    params: dict[str, Any] = copy.deepcopy(dict(spec.parameters))
    return params


def required_schema(specs: Sequence[ToolSpec], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a ``required`` answer: a non-empty array of calls of the tools (each
    ``{"name": one tool's name, "parameters": its arguments}``); ``$defs`` of the tools' schemas
    are lifted to the top so that their references resolve."""
    defs: dict[str, Any] = {}
    variants = []
    for i, spec in enumerate(specs):
        params = _parameters(spec)
        for name, definition in dict(params.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != definition:
                raise InvalidRequest(f"tools[{i}].parameters", f"$defs {name!r} differs from another tool's")
            defs[name] = definition
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [spec.name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def plan_tools(body: ChatRequest, parser: str | None) -> ToolPlan:
    """The ToolPlan of a chat request (InvalidRequest naming ``tools`` / ``tool_choice``);
    ``parser`` is the server's ``--tool-call-parser``."""
    if body.tools is not None and not body.tools:
        raise InvalidRequest("tools", "must not be empty: give at least one tool or leave tools out")
    specs = to_tools([t.model_dump(exclude_none=True) for t in body.tools]) if body.tools else None
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if specs else "none"
    if choice == "none":
        return ToolPlan(specs=specs)
    if not specs:
        raise InvalidRequest("tool_choice", "needs tools")
    parallel = body.parallel_tool_calls is not False
    if choice == "auto":
        return ToolPlan(specs=specs, mode=ToolMode.AUTO, parser=parser, parallel=parallel)
    if choice == "required":
        constraint = StructuredOutput.json(required_schema(specs, parallel))
        return ToolPlan(specs=specs, mode=ToolMode.REQUIRED, constraint=constraint, parallel=parallel)
    assert isinstance(choice, NamedToolChoice)
    by_name = {s.name: s for s in specs}
    spec = by_name.get(choice.function.name)
    if spec is None:
        raise InvalidRequest(
            "tool_choice", f"names {choice.function.name!r}, which is not one of the tools {sorted(by_name)}"
        )
    return ToolPlan(
        specs=specs,
        mode=ToolMode.NAMED,
        function=spec.name,
        constraint=StructuredOutput.json(_parameters(spec)),
        parallel=parallel,
    )


def new_call_id() -> str:
    """A tool call id in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {"id": call_id or new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@attrs.frozen
class AssistantAnswer:
    """The assistant message of one choice: content, tool calls (OpenAI shape), the
    finish_reason (``"tool_calls"`` where vLLM says so) and the malformed calls."""

    content: str | None
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    finish_reason: str = "stop"
    errors: tuple[Mapping[str, Any], ...] = ()

    def message(self) -> dict[str, Any]:
        """The ``message`` object (``tool_calls`` only when there are some, as vLLM)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        return out


def _parsed(found: ToolCalls | None, text: str, plan: ToolPlan, finish: str) -> AssistantAnswer:
    if found is None:
        return AssistantAnswer(text, finish_reason=finish)
    good = [c for c in found.calls if c.ok and c.name is not None]
    if not plan.parallel:
        good = good[:1]
    errors = tuple({"raw": c.raw, "error": c.error} for c in found.malformed)
    if not good:
        return AssistantAnswer(text, finish_reason=finish, errors=errors)
    calls = tuple(_call(c.name or "", c.arguments_json or json.dumps(dict(c.arguments or {})), c.id) for c in good)
    content = found.content if found.content and found.content.strip() else None
    return AssistantAnswer(content, calls, "tool_calls", errors)


def _required(text: str, finish: str) -> AssistantAnswer:
    try:
        items = json.loads(text)
    except ValueError as exc:
        return AssistantAnswer(text, finish_reason=finish, errors=({"raw": text, "error": f"not JSON: {exc}"},))
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return AssistantAnswer(text, finish_reason=finish, errors=({"raw": text, "error": "not a list of calls"},))
    calls = tuple(_call(i["name"], json.dumps(i.get("parameters", {}))) for i in items)
    return AssistantAnswer("", calls, "tool_calls" if finish == "stop" else finish)


def answer(plan: ToolPlan, text: str, finish: str, found: ToolCalls | None) -> AssistantAnswer:
    """The assistant message of one output: ``text`` (its decoded content), the engine's
    ``finish`` reason and, for ``auto`` with a parser, what the engine's parser ``found``."""
    if plan.mode is ToolMode.NAMED and plan.function is not None:
        return AssistantAnswer("", (_call(plan.function, text),), finish)
    if plan.mode is ToolMode.REQUIRED:
        return _required(text, finish)
    if plan.mode is ToolMode.AUTO and plan.parser is not None:
        return _parsed(found, text, plan, finish)
    return AssistantAnswer(text, finish_reason=finish)
