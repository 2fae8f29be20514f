"""Tool calls (capability ``generate.tools``): tools as JSON schemas, parsed calls on completions.

Tools are given on a :class:`~rlinfer_core.types.GenerateRequest` (``tools``, ``tool_parser``) or
on a session. For chat requests the engine renders the chat template's tool section with them; for
every request with a ``tool_parser`` the facade parses the generated text into
:class:`ToolCall` objects with the **engine's own parser** (hook ``rlinfer_parse_tool_calls``) and
sets ``Completion.tool_calls``. The completion's ``token_ids`` stay the raw ids the model produced:
parsing never changes them.

A call that cannot be parsed, names an unknown tool, or whose arguments do not satisfy the tool's
schema is reported as a :class:`ToolCall` with ``error`` set, never raised.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.structured import check_json_schema

#: the contract's parser names; each backend maps them onto its engine's parsers
#: (vLLM: hermes -> "hermes", qwen -> "hermes", llama -> "llama3_json";
#: SGLang: hermes -> "hermes", qwen -> "qwen25", llama -> "llama3")
TOOL_PARSERS = ("hermes", "qwen", "llama")


@attrs.frozen
class ToolSpec:
    """One callable tool: its name, a description and a JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = attrs.field(factory=lambda: {"type": "object", "properties": {}}, eq=False)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``{"type": "function", "function": {...}}`` form (what chat templates and
        the engines' parsers take)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


def _tool(value: Any, i: int) -> ToolSpec:
    field = f"tools[{i}]"
    if isinstance(value, ToolSpec):
        spec = value
    elif isinstance(value, Mapping):
        inner = value.get("function", value) if value.get("type", "function") == "function" else None
        if not isinstance(inner, Mapping) or not isinstance(inner.get("name"), str):
            raise InvalidRequest(field, f"must be a ToolSpec or {{'name', 'description', 'parameters'}}, got {value!r}")
        spec = ToolSpec(
            name=inner["name"],
            description=inner.get("description", "") or "",
            parameters=inner.get("parameters", {"type": "object", "properties": {}}),
        )
    else:
        raise InvalidRequest(field, f"must be a ToolSpec or a mapping, got {type(value).__name__}")
    if not spec.name or not spec.name.replace("_", "a").replace("-", "a").replace(".", "a").isalnum():
        raise InvalidRequest(f"{field}.name", f"must be a non-empty identifier, got {spec.name!r}")
    if not isinstance(spec.description, str):
        raise InvalidRequest(f"{field}.description", f"must be a string, got {spec.description!r}")
    check_json_schema(spec.parameters, f"{field}.parameters")
    return spec


def to_tools(value: Any) -> tuple[ToolSpec, ...] | None:
    """Converter for ``tools`` fields: None, or a sequence of ToolSpec / OpenAI tool mappings
    (validated: names unique, parameters a valid JSON schema)."""
    if value is None:
        return None
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Sequence):
        raise InvalidRequest("tools", f"must be a list of tools, got {type(value).__name__}")
    tools = tuple(_tool(v, i) for i, v in enumerate(value))
    if not tools:
        raise InvalidRequest("tools", "must hold at least one tool (or be None)")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools", f"tool names must be unique, got {names}")
    return tools


def check_parser(value: Any) -> None:
    """Raise InvalidRequest naming ``tool_parser`` unless it is None or one of :data:`TOOL_PARSERS`."""
    if value is not None and value not in TOOL_PARSERS:
        raise InvalidRequest("tool_parser", f"must be one of {list(TOOL_PARSERS)} or None, got {value!r}")


@attrs.frozen
class ToolCall:
    """One tool call found in generated text.

    ``raw``: the call's text as the model wrote it (from the start marker to the end marker, or to
    the end of the output). ``arguments_json``: the arguments as JSON text. A malformed call has
    ``error`` set (and ``name``/``arguments`` None where they could not be read).
    """

    name: str | None
    arguments: Mapping[str, Any] | None = attrs.field(default=None, eq=False)
    arguments_json: str | None = None
    raw: str = ""
    id: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """True for a well-formed call of a known tool with schema-valid arguments."""
        return self.error is None


@attrs.frozen
class ToolCalls:
    """What a parser found in one completion: the calls in order, and the text around them."""

    parser: str
    calls: tuple[ToolCall, ...] = ()
    content: str | None = None  #: the text outside the calls (None when there is none)

    @property
    def malformed(self) -> tuple[ToolCall, ...]:
        """The calls with ``error`` set."""
        return tuple(c for c in self.calls if not c.ok)


def check_calls(found: ToolCalls, tools: Sequence[ToolSpec]) -> ToolCalls:
    """Mark calls of unknown tools and calls whose arguments break the tool's schema as malformed
    (engine parsers check only the syntax). Engine-agnostic, done by the facade."""
    import jsonschema  # type: ignore[import-untyped]

    by_name = {t.name: t for t in tools}
    out = []
    for call in found.calls:
        if call.error is None:
            spec = by_name.get(call.name or "")
            if spec is None:
                call = attrs.evolve(call, error=f"unknown tool {call.name!r}; tools are {sorted(by_name)}")
            else:
                arguments = call.arguments
                if arguments is None and call.arguments_json is not None:
                    try:
                        arguments = json.loads(call.arguments_json)
                    except ValueError as exc:
                        call = attrs.evolve(call, error=f"arguments are not JSON: {exc}")
                if call.error is None:
                    validator = jsonschema.validators.validator_for(
                        spec.parameters, default=jsonschema.Draft202012Validator
                    )
                    problem = next(iter(validator(spec.parameters).iter_errors(arguments)), None)
                    call = attrs.evolve(
                        call,
                        arguments=arguments,
                        error=None if problem is None else f"arguments do not match the schema: {problem.message}",
                    )
        out.append(call)
    return attrs.evolve(found, calls=tuple(out))


#: the call markers of hermes-style tool calls (hermes, qwen)
HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def hermes_segments(text: str) -> tuple[list[str], str]:
    """``<tool_call>`` segments of ``text`` (each to its ``</tool_call>``, or to the end) and the
    text outside them. Backends parse each segment on its own with their engine's parser, so one
    malformed call is reported while the others still parse."""
    segments: list[str] = []
    outside: list[str] = []
    pos = 0
    while True:
        start = text.find(HERMES_START, pos)
        if start < 0:
            outside.append(text[pos:])
            return segments, "".join(outside)
        outside.append(text[pos:start])
        end = text.find(HERMES_END, start + len(HERMES_START))
        stop = len(text) if end < 0 else end + len(HERMES_END)
        segments.append(text[start:stop])
        pos = stop
