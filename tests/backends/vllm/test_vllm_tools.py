"""vLLM's own tool parsers behind rlinfer's contract names (no engine starts: parsers need only the
tokenizer). The kit's test_tool_calls_use_the_engine_parser runs the same through a real engine."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from rlinfer_core.tiny_model import make_tiny_model
from rlinfer_core.tools import ToolSpec, check_calls
from rlinfer_vllm.tools import ToolParsing, hermes_segments

ADD = ToolSpec(
    "add",
    "add two integers",
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
)
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture(scope="module")
def parsing(tmp_path_factory: pytest.TempPathFactory) -> ToolParsing:
    from transformers import AutoTokenizer

    model: Path = make_tiny_model(tmp_path_factory.mktemp("tools") / "m")
    return ToolParsing(AutoTokenizer.from_pretrained(str(model)))


def test_segments_split_on_markers() -> None:
    segments, outside = hermes_segments(f"a {CALL} b <tool_call>open")
    assert segments == [CALL, "<tool_call>open"]
    assert outside == "a  b "


def test_one_bad_call_does_not_hide_the_good_ones(parsing: ToolParsing) -> None:
    # vLLM's hermes parser alone returns no calls for this text (one body is not JSON)
    found = check_calls(parsing.parse(f"{CALL} then <tool_call>oops</tool_call>{CALL}", "hermes", [ADD]), [ADD])
    assert [c.ok for c in found.calls] == [True, False, True]
    assert found.calls[1].raw == "<tool_call>oops</tool_call>" and "JSON" in (found.calls[1].error or "")
    assert found.content == "then"


def test_llama_without_python_tag_token(parsing: ToolParsing) -> None:
    found = parsing.parse('{"name": "add", "parameters": {"a": 2, "b": 3}}', "llama", [ADD])
    assert [(c.name, dict(c.arguments or {})) for c in found.calls] == [("add", {"a": 2, "b": 3})]
    bad = parsing.parse('x {"nope": 1}', "llama", [ADD])
    assert len(bad.calls) == 1 and not bad.calls[0].ok and bad.calls[0].raw == '{"nope": 1}'
