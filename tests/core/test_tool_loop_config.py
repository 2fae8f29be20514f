"""The tool loop without an engine: verl's multi_turn section and tool config read into a
ToolLoopConfig, tools built by dotted path, and the loop's rules (timeouts, failures, limits)
run against a scripted session double. The loop on real engines is the kit's test_tool_loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlinfer_core.config_file import read_config_file
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.example_tools import CALCULATOR_SCHEMA, Calculator
from rlinfer_core.session import SessionResult, Turn
from rlinfer_core.tool_loop import ToolDefinition, ToolLoopConfig, TruncateSide, read_tool_config
from rlinfer_core.tool_runner import ToolEpisode, run_tool_loop
from rlinfer_core.tools import ToolCall, ToolCalls
from rlinfer_core.types import EngineConfig, SamplingParams

DATA = Path(__file__).parent / "data" / "verl"

#: verl's gsm8k tool config, with the calculator in place of verl's Gsm8kTool
TOOL_CONFIG = {
    "tools": [
        {
            "class_name": "rlinfer_core.example_tools.Calculator",
            "config": {"type": "native", "offset": 100},
            "tool_schema": dict(CALCULATOR_SCHEMA),
        }
    ]
}


def write_files(folder: Path, multi_turn: Mapping[str, Any], tools: Any = TOOL_CONFIG) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tools.yaml").write_text(yaml.safe_dump(tools))
    path = folder / "verl.yaml"
    path.write_text(
        yaml.safe_dump({"actor_rollout_ref": {"rollout": {"name": "vllm", "multi_turn": dict(multi_turn)}}})
    )
    return path


def test_verls_own_files_read_their_multi_turn_section() -> None:
    assert read_config_file(DATA / "ppo_trainer_excerpt.yaml").tool_loop is None, "enable: false"
    loop = read_config_file(DATA / "gsm8k_multiturn_grpo.yaml").tool_loop
    assert loop is not None and loop.max_assistant_turns == 5 and loop.tools == ()
    assert loop.tool_parser == "hermes"


def test_the_multi_turn_section_and_its_tool_config(tmp_path: Path) -> None:
    section = {
        "enable": True,
        "max_assistant_turns": 3,
        "max_user_turns": 2,
        "max_parallel_calls": 4,
        "max_tool_response_length": 64,
        "tool_response_truncate_side": "left",
        "tokenization_sanity_check_mode": "disable",
        "use_inference_chat_template": False,
        "format": "qwen",
        "tool_config_path": "tools.yaml",
        "tool_timeout_s": 2.5,
        "max_concurrent_tools": 3,
    }
    loop = ToolLoopConfig.from_file(write_files(tmp_path, section))
    assert (loop.max_assistant_turns, loop.max_tool_rounds, loop.max_parallel_calls) == (3, 2, 4)
    assert (loop.max_tool_response_length, loop.tool_response_truncate_side) == (64, "left")
    assert (loop.tool_parser, loop.strict, loop.tool_timeout_s, loop.max_concurrent_tools) == ("qwen", False, 2.5, 3)
    (tool,) = loop.tools
    assert tool.class_path == "rlinfer_core.example_tools.Calculator" and tool.spec.name == "calc"
    built = tool.build()
    assert isinstance(built, Calculator) and built.offset == 100 and built.tool_schema == tool.spec.to_openai()


def test_the_tool_config_path_is_found_next_to_the_file_else_in_the_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "elsewhere").mkdir()
    write_files(tmp_path / "elsewhere", {})
    config = write_files(tmp_path / "conf", {"enable": True, "tool_config_path": "elsewhere/tools.yaml"})
    with pytest.raises(InvalidRequest, match="no such file") as info:
        read_config_file(config)
    assert info.value.field == "multi_turn.tool_config_path"
    monkeypatch.chdir(tmp_path)  # verl's examples name the tool config from where verl runs
    assert read_config_file(config).tool_loop is not None


def test_older_tool_configs_split_the_class_path(tmp_path: Path) -> None:
    entry = {"class_path": "rlinfer_core.example_tools", "class_name": "Calculator", "tool_schema": CALCULATOR_SCHEMA}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"tools": [entry]}))
    (tool,) = read_tool_config(tmp_path / "t.yaml")
    assert tool.class_path == "rlinfer_core.example_tools.Calculator" and tool.config == {}


@pytest.mark.parametrize(
    "section,field",
    [
        ({"enable": True, "format": "gpt-oss"}, "multi_turn.format"),
        ({"enable": True, "max_assistant_turns": 0}, "multi_turn.max_assistant_turns"),
        ({"enable": True, "tool_timeout_s": -1}, "multi_turn.tool_timeout_s"),
        ({"enable": True, "tokenization_sanity_check_mode": "loose"}, "multi_turn.tokenization_sanity_check_mode"),
        ({"enable": True, "interaction_config_path": "i.yaml"}, "multi_turn.interaction_config_path"),
        ({"enable": "yes"}, "multi_turn.enable"),
        ({"enable": True, "max_turns": 3}, "multi_turn.max_turns"),
    ],
)
def test_bad_multi_turn_values_name_their_key_and_the_file(tmp_path: Path, section: dict[str, Any], field: str) -> None:
    path = write_files(tmp_path, section)
    with pytest.raises(InvalidRequest) as info:
        read_config_file(path)
    assert info.value.field == field and str(path) in str(info.value)


@pytest.mark.parametrize(
    "entry,field",
    [
        ({"class_name": "x.Y", "config": {"type": "mcp"}, "tool_schema": CALCULATOR_SCHEMA}, "tools[0].config.type"),
        ({"class_name": "x.Y"}, "tools[0].tool_schema"),
        ({"tool_schema": CALCULATOR_SCHEMA}, "tools[0].class_name"),
        (
            {"class_name": "x.Y", "tool_schema": {"type": "function", "function": {"name": "a b"}}},
            "tools[0].tool_schema",
        ),
        ({"class_name": "x.Y", "tool_schema": CALCULATOR_SCHEMA, "extra": 1}, "tools[0].extra"),
    ],
)
def test_bad_tool_entries_are_refused(tmp_path: Path, entry: dict[str, Any], field: str) -> None:
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"tools": [entry]}))
    with pytest.raises(InvalidRequest) as info:
        read_tool_config(tmp_path / "t.yaml")
    assert info.value.field == field


def test_tools_are_imported_only_when_built() -> None:
    tool = ToolDefinition(CALCULATOR_SCHEMA, class_path="no_such_package.Tool")  # reading imports nothing
    with pytest.raises(InvalidRequest, match="cannot import"):
        tool.build()
    with pytest.raises(InvalidRequest, match="exactly one"):
        ToolDefinition(CALCULATOR_SCHEMA)
    with pytest.raises(InvalidRequest, match="unique"):
        ToolLoopConfig(tools=[ToolDefinition.of(Calculator()), ToolDefinition.of(Calculator())])


def test_truncation_follows_verls_sides() -> None:
    text = "abcdefghij"
    sides: tuple[TruncateSide, ...] = ("left", "right", "middle")
    cut = {side: ToolLoopConfig(max_tool_response_length=4, tool_response_truncate_side=side) for side in sides}
    assert cut["left"].truncate(text) == "abcd...(truncated)"
    assert cut["right"].truncate(text) == "(truncated)...ghij"
    assert cut["middle"].truncate(text) == "ab...(truncated)...ij"
    assert ToolLoopConfig().truncate(text) == text


# --- the loop against a scripted session -----------------------------------------------------


class ScriptedSession:
    """A session double: each model turn makes the calls its script names (no calls: the end)."""

    def __init__(self, script: Sequence[Sequence[ToolCall]], seen: list[SamplingParams]) -> None:
        self.script = list(script)
        self.seen = seen
        self.turns: list[Turn] = []
        self.messages: list[dict[str, Any]] = []

    async def generate(self, sampling: SamplingParams | None = None) -> Turn:
        assert sampling is not None
        self.seen.append(sampling)
        calls = tuple(self.script.pop(0)) if self.script else ()
        turn = Turn("model", 0, 0, role="assistant", tool_calls=ToolCalls("hermes", calls))
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": ""})
        return turn

    def add_tool_result(self, content: str, *, name: str | None = None, tool_call_id: str | None = None) -> Turn:
        self.messages.append({"role": "tool", "content": content, "name": name})
        return Turn("environment", 0, 0, role="tool", text=content)

    def result(self) -> SessionResult:
        return SessionResult((), (), (), (), tuple(self.turns), tuple(self.messages), True)


class ScriptedEngine:
    """An engine double whose sessions follow one script per prompt (the prompt's text)."""

    def __init__(self, scripts: Mapping[str, Sequence[Sequence[ToolCall]]]) -> None:
        self.scripts = scripts
        self.config = EngineConfig(model="/m")
        self.seen: list[SamplingParams] = []
        self.opened: list[dict[str, Any]] = []

    def session(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> ScriptedSession:
        self.opened.append(kwargs)
        return ScriptedSession(self.scripts[messages[-1]["content"]], self.seen)


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name, arguments, raw=f"<{name}>")


class Raising:
    async def __call__(self, arguments: dict[str, Any]) -> str:
        raise KeyError("broken on purpose")


class Hanging:
    async def __call__(self, arguments: dict[str, Any]) -> str:
        await asyncio.sleep(3600)
        return ""


def blocking_echo(arguments: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.05)  # a plain function runs in a thread
    return {"text": f"echo {arguments['x']}"}


ANY_OBJECT = {"type": "object"}


def loop_config(**fields: Any) -> ToolLoopConfig:
    tools = [
        ToolDefinition.of(Calculator()),
        ToolDefinition({"name": "boom", "parameters": ANY_OBJECT}, implementation=Raising()),
        ToolDefinition({"name": "slow", "parameters": ANY_OBJECT}, implementation=Hanging()),
        ToolDefinition({"name": "echo", "parameters": ANY_OBJECT}, implementation=blocking_echo),
    ]
    return ToolLoopConfig(tools=tools, tool_timeout_s=0.3, **fields)


def run(engine: ScriptedEngine, prompts: list[str], config: ToolLoopConfig, **kwargs: Any) -> list[ToolEpisode]:
    return asyncio.run(run_tool_loop(engine, prompts, config, **kwargs))  # type: ignore[arg-type]


def test_failing_tools_stay_in_their_episode() -> None:
    scripts = {
        "ok": [[call("calc", a=2, b=3)], [call("calc", a=1, b=1)]],
        "raises": [[call("boom")]],
        "hangs": [[call("slow")]],
        "malformed": [[ToolCall(None, raw="<tool_call>{", error="not JSON")], [call("nope")]],
        "echo": [[call("echo", x=7)]],
    }
    engine = ScriptedEngine(scripts)
    started = time.perf_counter()
    episodes = run(engine, list(scripts), loop_config())
    assert time.perf_counter() - started < 5, "the hanging tool is cut at its timeout"
    ok, raises, hangs, malformed, echo = episodes
    assert [e.result for e in ok.events] == ["5", "2"] and ok.assistant_turns == 3 and ok.stop == "no_tool_call"
    assert [e.metrics for e in ok.events] == [{"calls": 1}, {"calls": 2}], "one verl instance per episode"
    assert "KeyError" in (raises.events[0].error or "") and raises.assistant_turns == 2
    assert raises.result.messages[1]["content"] == f"error: {raises.events[0].error}"
    assert "timed out after 0.3 s" in (hangs.events[0].error or "") and hangs.events[0].seconds >= 0.29
    assert [e.error for e in malformed.events] == ["not JSON", "unknown tool 'nope'"]
    assert echo.events[0].result == "echo 7" and echo.events[0].ok
    assert all(o["tool_parser"] == "hermes" and len(o["tools"]) == 4 for o in engine.opened)


def test_limits_end_the_episode() -> None:
    forever = [[call("calc", a=1, b=1), call("calc", a=2, b=2), call("calc", a=3, b=3)]] * 10
    engine = ScriptedEngine({"p": forever})
    (episode,) = run(engine, ["p"], loop_config(max_assistant_turns=3, max_parallel_calls=2))
    assert (episode.stop, episode.assistant_turns) == ("max_assistant_turns", 3)
    assert [e.result for e in episode.events if e.ok] == ["2", "4"] * 2, "the last turn's calls do not run"
    assert [e.error for e in episode.events if not e.ok] == ["not run: more than max_parallel_calls=2"] * 2
    (episode,) = run(engine, ["p"], loop_config(max_tool_rounds=1))
    assert (episode.stop, episode.assistant_turns) == ("max_tool_rounds", 1)
    assert [e.ok for e in episode.events] == [True, False, False], "max_parallel_calls is verl's 1 by default"


def test_sampling_is_fixed_per_turn_or_the_engines_default() -> None:
    engine = ScriptedEngine({"p": [[call("calc", a=1, b=2)]]})
    run(engine, ["p"], loop_config(), sampling=lambda episode, turn: SamplingParams(max_tokens=10 + turn))
    assert [s.max_tokens for s in engine.seen] == [10, 11]
    engine.seen.clear()
    engine.config = EngineConfig(model="/m", default_sampling=SamplingParams(n=4, max_tokens=7))
    run(engine, ["p"], loop_config())
    assert [(s.n, s.max_tokens) for s in engine.seen] == [(1, 7), (1, 7)], "a session holds one trajectory"
    with pytest.raises(InvalidRequest) as info:
        run(engine, [[]], loop_config())  # type: ignore[list-item]
    assert info.value.field == "prompts[0]"
