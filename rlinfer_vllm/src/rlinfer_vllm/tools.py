"""Tool calls for the vLLM backend (capability ``generate.tools``) with vLLM's own parsers.

The contract's parser names map onto vLLM's registered tool parsers
(:data:`ENGINE_PARSERS`): ``hermes`` and ``qwen`` -> ``"hermes"`` (vLLM aliases Qwen2.5's JSON
tool calls to it), ``llama`` -> ``"llama3_json"``. Each parser is built as vLLM's OpenAI server
builds it (``cls(tokenizer, tools)``) and its ``extract_tool_calls`` reads the text.

vLLM's parsers return *no* calls when any call in the text is malformed (hermes ``json.loads``
every ``<tool_call>`` body and gives up on the first failure). The contract reports each bad call
on its own, so hermes-style text is split on the call markers and each ``<tool_call>...`` segment
is parsed alone: a segment the parser cannot read becomes ``ToolCall(name=None, raw=segment,
error=...)``. Llama-style text has no markers; it is parsed whole, and text with a JSON object
the parser cannot read as a call is one malformed call from that object to the end.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.tools import HERMES_END as END
from rlinfer_core.tools import HERMES_START as START
from rlinfer_core.tools import ToolCall, ToolCalls, ToolSpec, hermes_segments

#: contract parser name -> vLLM tool parser name (vllm.tool_parsers.ToolParserManager)
ENGINE_PARSERS = {"hermes": "hermes", "qwen": "hermes", "llama": "llama3_json"}


class ToolParsing:
    """Builds vLLM's tool parsers (once per parser and tool set) over the engine's tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def _parser(self, parser: str, tools: Sequence[ToolSpec]) -> tuple[Any, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager
        from vllm.tool_parsers.abstract_tool_parser import ToolParser

        name = ENGINE_PARSERS.get(parser)
        if name is None:
            raise InvalidRequest("tool_parser", f"must be one of {sorted(ENGINE_PARSERS)}, got {parser!r}")
        request = ChatCompletionRequest(messages=[], tools=[t.to_openai() for t in tools] or None)
        cls = ToolParserManager.get_tool_parser(name)
        try:
            instance = cls(self._tokenizer, request.tools)
        except RuntimeError:
            # Llama3JsonToolParser refuses tokenizers without its <|python_tag|> token, which it
            # needs for streaming only; extract_tool_calls reads plain JSON without it.
            instance = cls.__new__(cls)
            ToolParser.__init__(instance, self._tokenizer, request.tools)
            instance.bot_token_id = None
        return instance, request

    def parse(self, text: str, parser: str, tools: Sequence[ToolSpec]) -> ToolCalls:
        """Tool calls in ``text`` by vLLM's parser for the contract name ``parser``."""
        instance, request = self._parser(parser, tools)
        if parser == "llama":
            return self._parse_llama(instance, request, text)
        segments, outside = hermes_segments(text)
        calls = [self._parse_segment(instance, request, segment) for segment in segments]
        if not segments:
            found = _extract(instance, request, text)
            return ToolCalls(parser, (), found.content if found is not None else text)
        content = outside.strip()
        return ToolCalls(parser, tuple(calls), content or None)

    @staticmethod
    def _parse_segment(instance: Any, request: Any, segment: str) -> ToolCall:
        found = _extract(instance, request, segment)
        if found is None or not found.tools_called or len(found.tool_calls) != 1:
            body = segment.removeprefix(START).removesuffix(END).strip()
            return ToolCall(name=None, raw=segment, error=_why(body, segment.endswith(END)))
        return _call(found.tool_calls[0], segment)

    @staticmethod
    def _parse_llama(instance: Any, request: Any, text: str) -> ToolCalls:
        found = _extract(instance, request, text)
        if found is not None and found.tools_called:
            raw = text.strip()
            calls = tuple(_call(c, raw if len(found.tool_calls) == 1 else "") for c in found.tool_calls)
            return ToolCalls("llama", calls, found.content)
        start = text.find("{")
        if start < 0:
            return ToolCalls("llama", (), text or None)
        segment = text[start:]
        call = ToolCall(name=None, raw=segment, error=_why(segment, True, llama=True))
        return ToolCalls("llama", (call,), text[:start].strip() or None)


def _extract(instance: Any, request: Any, text: str) -> Any:
    """vLLM's ``extract_tool_calls`` (it logs a traceback for every malformed call: muted)."""
    logger = logging.getLogger("vllm.tool_parsers")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        return instance.extract_tool_calls(text, request)
    except Exception:
        return None
    finally:
        logger.setLevel(level)


def _call(found: Any, raw: str) -> ToolCall:
    arguments_json = found.function.arguments
    try:
        arguments = json.loads(arguments_json)
    except ValueError:
        arguments = None
    return ToolCall(
        name=found.function.name,
        arguments=arguments if isinstance(arguments, dict) else None,
        arguments_json=arguments_json,
        raw=raw,
        id=found.id,
        error=None if isinstance(arguments, dict) else "the arguments are not a JSON object",
    )


def _why(body: str, closed: bool, llama: bool = False) -> str:
    """Why the engine's parser could not read a call (for ToolCall.error)."""
    try:
        obj = json.loads(body)
    except ValueError as exc:
        suffix = "" if closed else f" (no closing {END})"
        return f"the call is not valid JSON: {exc}{suffix}"
    keys = "name and parameters/arguments" if llama else "name and arguments"
    return f"the call must be a JSON object with {keys}, got {obj!r}"[:300]
