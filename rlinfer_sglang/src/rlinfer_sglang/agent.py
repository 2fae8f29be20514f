"""Tool calls (capability ``generate.tools``) and structured output (``generate.structured``) for
the SGLang backend, with SGLang's own function-call parsers and grammar backend.

**Tool calls.** The contract's parser names map onto SGLang's ``FunctionCallParser`` formats
(:data:`ENGINE_PARSERS`): ``hermes`` -> ``"hermes"``, ``qwen`` -> ``"qwen25"``, ``llama`` ->
``"llama3"``. SGLang's parsers return *no* calls when any call in the text is malformed (hermes
``json.loads`` every ``<tool_call>`` body and gives up on the first failure) and silently drop
calls of unknown tools. The contract reports each bad call on its own, so hermes-style text is
split on the call markers and each ``<tool_call>...`` segment is parsed alone: a segment the
parser cannot read becomes ``ToolCall(name=None, raw=segment, error=...)``; a segment SGLang drops
although it holds a named call is returned with its name so that the facade marks it (unknown
tool). SGLang's ``qwen25`` detector needs the Qwen2.5 template's newlines inside the markers
(``<tool_call>\\n{...}\\n</tool_call>``); each segment is handed to it in that form. Llama-style
text has no markers; it is parsed whole.

**Structured output.** ``request.sampling.structured`` becomes SGLang's ``json_schema`` /
``regex`` sampling parameter (a choice is the regex ``(a|b|...)`` of the escaped options); the
grammar backend is SGLang's default, xgrammar, whose CPU bitmask path SGLang uses for CPU logits.
SGLang applies the grammar mask to the logits in place before its sampler (``apply_logits_bias``
in the model runner), so ``processed`` logprobs include the mask; ``raw`` ones come from the
backend's scoring prefill, which carries no grammar. JSON is generated compact
(``constrained_json_disable_any_whitespace``, set by :mod:`rlinfer_sglang.config`), so a model
cannot spend its tokens on whitespace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.structured import StructuredKind, StructuredOutput
from rlinfer_core.tools import HERMES_END as END
from rlinfer_core.tools import HERMES_START as START
from rlinfer_core.tools import ToolCall, ToolCalls, ToolSpec, hermes_segments

#: contract parser name -> SGLang tool_call_parser (FunctionCallParser.ToolCallParserEnum)
ENGINE_PARSERS = {"hermes": "hermes", "qwen": "qwen25", "llama": "llama3"}


_REGEX_SPECIALS = set("\\.^$*+?{}[]|()")


def escape(text: str) -> str:
    """``text`` as a regex literal, escaping only the regex operators (grammar engines reject
    some of the extra escapes ``re.escape`` adds, e.g. ``\\-`` outside a class)."""
    return "".join("\\" + c if c in _REGEX_SPECIALS else c for c in text)


def structured_params(constraint: StructuredOutput | None) -> dict[str, Any]:
    """SGLang sampling parameters enforcing ``constraint`` ({} when None)."""
    if constraint is None:
        return {}
    if constraint.kind is StructuredKind.JSON_SCHEMA:
        return {"json_schema": constraint.schema_json}
    if constraint.kind is StructuredKind.REGEX:
        return {"regex": constraint.value}
    if constraint.kind is StructuredKind.EBNF:
        return {"ebnf": constraint.value}
    return {"regex": "(" + "|".join(escape(c) for c in constraint.value) + ")"}


@contextmanager
def _quiet() -> Iterator[None]:
    """SGLang's detectors log an error for every malformed call: muted while parsing."""
    logger = logging.getLogger("sglang.srt.function_call")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _engine_parser(parser: str, tools: Sequence[ToolSpec]) -> Any:
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    name = ENGINE_PARSERS.get(parser)
    if name is None:
        raise InvalidRequest("tool_parser", f"must be one of {sorted(ENGINE_PARSERS)}, got {parser!r}")
    return FunctionCallParser(tools=[Tool(**t.to_openai()) for t in tools], tool_call_parser=name)


def _run(engine_parser: Any, text: str) -> list[Any] | None:
    """SGLang's ``parse_non_stream`` calls (None when it raised)."""
    try:
        with _quiet():
            _, calls = engine_parser.parse_non_stream(text)
    except Exception:
        return None
    return list(calls)


def parse(text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
    """Tool calls in ``text`` by SGLang's parser for the contract name ``parser``."""
    engine_parser = _engine_parser(parser, tools)
    if parser == "llama":
        return _parse_llama(engine_parser, text)
    segments, outside = hermes_segments(text)
    if not segments:
        return ToolCalls(parser, (), text or None)
    calls = tuple(_parse_segment(engine_parser, parser, segment) for segment in segments)
    return ToolCalls(parser, calls, outside.strip() or None)


def _parse_segment(engine_parser: Any, parser: str, segment: str) -> ToolCall:
    closed = segment.endswith(END)
    body = segment[len(START) :].removesuffix(END).strip() if closed else segment[len(START) :].strip()
    canonical = f"{START}\n{body}\n{END}" if parser == "qwen" and closed else segment
    found = _run(engine_parser, canonical)
    if found is not None and len(found) == 1:
        return _call(found[0], segment)
    return _unread(body, segment, closed)


def _parse_llama(engine_parser: Any, text: str) -> ToolCalls:
    found = _run(engine_parser, text.strip())
    if found:
        raw = text.strip()
        return ToolCalls("llama", tuple(_call(c, raw if len(found) == 1 else "") for c in found), None)
    start = text.find("{")
    if start < 0:
        return ToolCalls("llama", (), text or None)
    segment = text[start:]
    return ToolCalls("llama", (_unread(segment.strip(), segment, True, llama=True),), text[:start].strip() or None)


def _call(found: Any, raw: str) -> ToolCall:
    arguments_json = str(found.parameters)
    try:
        arguments = json.loads(arguments_json)
    except ValueError:
        arguments = None
    return ToolCall(
        name=found.name,
        arguments=arguments if isinstance(arguments, dict) else None,
        arguments_json=arguments_json,
        raw=raw,
        error=None if isinstance(arguments, dict) else "the arguments are not a JSON object",
    )


def _unread(body: str, raw: str, closed: bool, llama: bool = False) -> ToolCall:
    """A call SGLang's parser returned nothing for: the reason, or, for a well-formed call that
    SGLang dropped (it drops calls of unknown tools), the call itself for the facade to judge."""
    try:
        obj = json.loads(body)
    except ValueError as exc:
        suffix = "" if closed else f" (no closing {END})"
        return ToolCall(name=None, raw=raw, error=f"the call is not valid JSON: {exc}{suffix}")
    if not closed:
        return ToolCall(name=None, raw=raw, error=f"the call has no closing {END}")
    key = "parameters" if llama and isinstance(obj, dict) and "parameters" in obj else "arguments"
    if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get(key, {}), dict):
        arguments = obj.get(key, {})
        return ToolCall(
            name=obj["name"],
            arguments=arguments,
            arguments_json=json.dumps(arguments, ensure_ascii=False),
            raw=raw,
            error=None,
        )
    keys = "name and parameters/arguments" if llama else "name and arguments"
    return ToolCall(name=None, raw=raw, error=f"the call must be a JSON object with {keys}, got {obj!r}"[:300])


__all__ = ["ENGINE_PARSERS", "escape", "parse", "structured_params"]
