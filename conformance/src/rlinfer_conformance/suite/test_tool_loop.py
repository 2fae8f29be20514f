"""The multi-turn tool loop from verl's config (issue 28): ``rollout.multi_turn`` and a verl tool
config drive ``engine.run_tool_loop`` over a batch of 8 prompts. Every model token is checked
against the oracle, every episode's tokens against the chat template (as the session tests do),
and tools that raise or hang stay in their episode.

A random tiny model never writes a tool call by itself: the turns that must call are held to the
call format with a regex (as test_structured_tool_call_is_parsed does) and stopped at
``</tool_call>`` (the tiny model's EOS is not its template's end of turn; a stop string leaves the
closing to the template). Those turns are greedy under the grammar, so their tokens need not be
the oracle's argmax: their raw logprobs are compared with the oracle's log_softmax instead.
The kit's context is 512 tokens and the tiny tokenizer spends ~100 tokens on each tool in the
template's tool section, so the calculator batch and the failing-tools batch are two runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from rlinfer_conformance.agent_oracle import raw_logprobs
from rlinfer_conformance.kit_tools import RAISED
from rlinfer_conformance.suite.test_agent import check_continuity
from rlinfer_conformance.world import LOGPROB_TOLERANCE, KitWorld
from rlinfer_core.config_file import read_config_file
from rlinfer_core.example_tools import CALCULATOR_SCHEMA
from rlinfer_core.tool_loop import ToolLoopConfig
from rlinfer_core.tool_runner import ToolEpisode
from rlinfer_core.types import Capability, GenerateRequest, SamplingParams

__all__ = ["test_tool_loop_from_verl_config_at_oracle_parity", "test_tool_loop_keeps_failing_tools_in_their_episode"]

CALC_CALL = r'<tool_call>\{"name": "calc", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
FREE = SamplingParams(temperature=0.0, max_tokens=6)
#: seconds the hanging tool is given
TOOL_TIMEOUT_S = 1.0
#: the schemas of the failing tools: as small as a tool gets (the kit's context is short)
SMALL = {"type": "object"}


def _forced(w: KitWorld, regex: str) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=80,  # a call is ~60 tokens of the byte-level tiny tokenizer
        structured={"regex": regex},
        stop=("</tool_call>",),
        logprobs_mode="raw" if w.supports(Capability.LOGPROBS_RAW) else "processed",
    )


def _call_of(name: str) -> str:
    return r'<tool_call>\{"name": "' + name + r'", "arguments": \{\}\}</tool_call>'


def _write_config(folder: Path, tools: list[dict[str, Any]], max_assistant_turns: int) -> Path:
    """verl's layout: the rollout section's multi_turn and a tool config next to it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tools.yaml").write_text(json.dumps({"tools": tools}))  # JSON is YAML
    rollout = {
        "multi_turn": {
            "enable": True,
            "max_assistant_turns": max_assistant_turns,
            "tool_config_path": "tools.yaml",
            "format": "hermes",
            "max_parallel_calls": 1,
            "tool_timeout_s": TOOL_TIMEOUT_S,
        }
    }
    path = folder / "rollout.yaml"
    path.write_text(json.dumps({"rollout": rollout}))
    return path


def _tool(class_name: str, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "function", "function": {"name": name, "description": "", "parameters": parameters}}
    return {"class_name": class_name, "config": {"type": "native"}, "tool_schema": schema}


def _check_episodes(
    w: KitWorld, config: ToolLoopConfig, episodes: Sequence[ToolEpisode], forced: Callable[[int, int], bool]
) -> None:
    """Continuity and loss mask as in the session tests; free turns at argmax and logprob parity;
    forced turns' raw logprobs equal to the oracle's log_softmax (where raw logprobs exist)."""
    free_requests: list[GenerateRequest] = []
    free_completions = []
    worst, checked = 0.0, 0
    for episode in episodes:
        result = episode.result
        assert result.exact, [t.note for t in result.turns if not t.exact]
        check_continuity(w, result, config.specs)
        versions = {result.token_versions[i] for i, m in enumerate(result.loss_mask) if m}
        assert versions == {w.engine.weight_version}
        tool_messages = [m["content"] for m in result.messages if m["role"] == "tool"]
        assert tool_messages == [e.result for e in episode.events if not e.error or "not run" not in e.error]
        model_turns = [t for t in result.turns if t.kind == "model"]
        assert len(model_turns) == episode.assistant_turns
        for k, turn in enumerate(model_turns):
            c = turn.completion
            assert c is not None
            if not forced(episode.index, k):
                free_requests.append(
                    GenerateRequest(prompt_token_ids=c.prompt_token_ids, sampling=FREE, request_id=c.request_id)
                )
                free_completions.append(c)
            elif w.supports(Capability.LOGPROBS_RAW):
                expected = raw_logprobs(w.oracle, w.current, c.prompt_token_ids, c.token_ids)
                worst = max(worst, *(abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)))
                checked += len(expected)
    w.check_parity("tool_loop", free_requests, free_completions)
    if checked:
        w.report.record_parity("tool_loop_forced_calls", worst, checked, 0)
        assert worst <= LOGPROB_TOLERANCE, worst


@pytest.mark.requires(Capability.SESSIONS, Capability.TOOLS, Capability.STRUCTURED, Capability.STOP_STRINGS)
@pytest.mark.hooks("rlinfer_generate", "rlinfer_parse_tool_calls")
def test_tool_loop_from_verl_config_at_oracle_parity(rlinfer_world: KitWorld) -> None:
    w = rlinfer_world
    calc = {"class_name": "rlinfer_core.example_tools.Calculator", "config": {"type": "native"}}
    path = _write_config(w.tmp / "tool_loop_calc", [{**calc, "tool_schema": CALCULATOR_SCHEMA}], 2)
    config = read_config_file(path).tool_loop
    assert config is not None and config.max_assistant_turns == 2 and config.tool_timeout_s == TOOL_TIMEOUT_S
    questions = [(a, b) for a in (2, 4) for b in (1, 3, 5, 7)]
    prompts = [f"{a} + {b}? use calc." for a, b in questions]
    always_calls, never_calls = 6, 7  # the others call once, then answer

    def forced(episode: int, turn: int) -> bool:
        return episode != never_calls and (turn == 0 or episode == always_calls)

    episodes = w.engine.run_tool_loop(prompts, config, lambda i, k: _forced(w, CALC_CALL) if forced(i, k) else FREE)
    assert [e.index for e in episodes] == list(range(8))
    for episode in episodes:
        assert episode.error is None, episode.error
        if episode.index == never_calls:
            assert (episode.stop, episode.assistant_turns, episode.events) == ("no_tool_call", 1, ())
            continue
        expected_calls = 2 if episode.index == always_calls else 1
        assert episode.stop == ("max_assistant_turns" if episode.index == always_calls else "no_tool_call")
        assert episode.assistant_turns == 2 and len(episode.events) == 1, episode
        event = episode.events[0]
        assert event.ok and event.name == "calc", event
        arguments = dict(event.arguments or {})
        assert event.result == str(arguments["a"] + arguments["b"])
        assert event.metrics == {"calls": 1} and event.reward == 0.0  # one verl instance per episode
        last = [t for t in episode.result.turns if t.kind == "model"][-1]
        assert (last.tool_calls is not None and len(last.tool_calls.calls) == 1) == (expected_calls == 2)
    _check_episodes(w, config, episodes, forced)


@pytest.mark.requires(Capability.SESSIONS, Capability.TOOLS, Capability.STRUCTURED, Capability.STOP_STRINGS)
@pytest.mark.hooks("rlinfer_generate", "rlinfer_parse_tool_calls")
def test_tool_loop_keeps_failing_tools_in_their_episode(rlinfer_world: KitWorld) -> None:
    w = rlinfer_world
    tools = [
        _tool("rlinfer_conformance.kit_tools.RaisingTool", "boom", SMALL),
        _tool("rlinfer_conformance.kit_tools.HangingTool", "slow", SMALL),
    ]
    config = ToolLoopConfig.from_file(_write_config(w.tmp / "tool_loop_failing", tools, 3))
    plan = ["boom", "slow", None, "boom", None, "slow", None, None]  # the tool each episode calls first

    def forced(episode: int, turn: int) -> bool:
        return turn == 0 and plan[episode] is not None

    def sampling(episode: int, turn: int) -> SamplingParams:
        name = plan[episode]
        return _forced(w, _call_of(name)) if forced(episode, turn) and name is not None else FREE

    episodes = w.engine.run_tool_loop([f"task {i}" for i in range(8)], config, sampling)
    for episode, name in zip(episodes, plan, strict=True):
        assert episode.stop == "no_tool_call" and episode.error is None, episode
        if name is None:
            assert episode.assistant_turns == 1 and episode.events == ()
            continue
        assert episode.assistant_turns == 2, "the model goes on after the failed call"
        (event,) = episode.events
        assert event.name == name and not event.ok
        if name == "boom":
            assert RAISED in (event.error or "") and "RuntimeError" in (event.error or ""), event
        else:
            assert "timed out" in (event.error or "") and event.seconds >= TOOL_TIMEOUT_S * 0.9, event
        assert event.result == f"error: {event.error}", "the error text is the tool message"
    _check_episodes(w, config, episodes, forced)
