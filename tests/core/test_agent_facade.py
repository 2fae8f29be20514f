"""Sessions, scoring, tool calls, structured output and LoRA in the facade, around the TEST-ONLY
recording double (see recording_double.py): the bookkeeping, not an engine's numbers (the kit
checks those on the real engines)."""

from __future__ import annotations

import asyncio
import importlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from recording_double import INSTANCES, RecordingDoubleBackend

from rlinfer_core.agent import derive_capabilities
from rlinfer_core.chat_template import TemplateContinuityError, load_tokenizer
from rlinfer_core.engine import AsyncEngine
from rlinfer_core.errors import InvalidRequest, UnsupportedCapability
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.scoring import ScoreRequest
from rlinfer_core.session import NO_VERSION
from rlinfer_core.tools import ToolSpec
from rlinfer_core.types import Capabilities, Capability, Completion, EngineConfig, GenerateRequest, SamplingParams

ADD = ToolSpec(
    "add",
    "add two numbers",
    {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]},
)


@pytest.fixture(scope="module", autouse=True)
def double_entry_point(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    site = tmp_path_factory.mktemp("double_site_agent")
    info = site / "rlinfer_double_backend-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlinfer-double-backend\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text("[rlinfer.backends]\ndouble = recording_double:DOUBLE_INFO\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(site))
        mp.delenv("RLINFER_BACKENDS", raising=False)
        mp.delenv("RLINFER_PLUGINS", raising=False)
        importlib.invalidate_caches()
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlinfer_core.tiny_model import TinyModelSpec, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0, spec=TinyModelSpec(num_hidden_layers=1))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def opened(tiny: Path, **engine_kwargs: Any) -> AsyncEngine:
    config = EngineConfig(model="m", tokenizer=str(tiny), request_timeout_s=5.0, engine_kwargs=engine_kwargs)
    engine = await AsyncEngine.open("double", config)
    engine.model_info = ModelInfo(384, 1024, (2,))  # the tiny tokenizer's ids and a longer context
    return engine


def backend() -> RecordingDoubleBackend:
    return INSTANCES[-1]


def test_derived_capabilities() -> None:
    bare = Capabilities("x", "1", "cpu", set())
    assert derive_capabilities(bare).supported == {Capability.SESSIONS}
    with_prompt = derive_capabilities(attrs.evolve(bare, supported={Capability.PROMPT_LOGPROBS}))
    assert {Capability.SESSIONS, Capability.SCORE} <= with_prompt.supported
    assert "prompt_logprobs" in with_prompt.notes["score"]
    turned_off = attrs.evolve(
        bare, supported={Capability.WEIGHTS_TENSORS}, notes={"weights.delta": "the backend cannot replay one"}
    )
    assert Capability.WEIGHTS_DELTA in derive_capabilities(attrs.evolve(turned_off, notes={})).supported
    assert Capability.WEIGHTS_DELTA not in derive_capabilities(turned_off).supported
    assert derive_capabilities(turned_off).notes["weights.delta"] == "the backend cannot replay one"


def test_chat_session_three_turns_with_tool_results(tiny: Path) -> None:
    async def body() -> None:
        engine = await opened(tiny)
        session = engine.session(tools=[ADD], tool_parser="hermes", sampling=SamplingParams(max_tokens=5))
        session.add_message("user", "what is 2 + 3?")
        turns = []
        for k in range(3):
            before = session.token_ids
            turn = await session.generate()
            assert turn.completion is not None  # the prompt is exactly the tokens so far (+ generation prompt)
            assert turn.completion.prompt_token_ids == session.token_ids[: turn.start]
            assert turn.completion.prompt_token_ids[: len(before)] == before
            assert turn.tool_calls is not None and turn.tool_calls.parser == "hermes"
            turns.append(turn)
            if k < 2:
                session.add_tool_result(f"result {k}", name="add")
        if True:  # a weight update between turns is survived; tokens carry their version
            await engine.update_weights({"w": torch.ones(2, 2), "b": torch.zeros(2)})
            session.add_message("user", "again")
            last = await session.generate()
        episode = session.result()
        tok = load_tokenizer(str(tiny))
        n = len(episode.token_ids)
        assert len(episode.loss_mask) == len(episode.logprobs) == len(episode.token_versions) == n
        model = [i for t in episode.turns if t.kind == "model" for i in range(t.start, t.end)]
        assert [i for i in range(n) if episode.loss_mask[i]] == model
        assert all(episode.logprobs[i] == -0.5 for i in model)
        assert all(episode.token_versions[i] == NO_VERSION for i in range(n) if i not in model)
        assert {episode.token_versions[i] for i in range(last.start, last.end)} == {1}
        assert {episode.token_versions[i] for t in turns for i in range(t.start, t.end)} == {0}
        # continuity: the whole-conversation rendering is the session's text, and its tokens are the
        # session's once the model's own spans are re-tokenised the canonical way
        whole = tok.apply_chat_template(episode.messages, tools=[ADD.to_openai()], tokenize=False)
        assert tok.decode(list(episode.token_ids), skip_special_tokens=False) == whole
        canonical = []
        for t in episode.turns:
            span = list(episode.token_ids[t.start : t.end])
            canonical += tok(tok.decode(span), add_special_tokens=False).input_ids if t.kind == "model" else span
        assert canonical == tok(whole, add_special_tokens=False).input_ids
        assert episode.exact and [t.kind for t in episode.turns].count("model") == 4
        assert episode.messages[0]["role"] == "user" and episode.messages[2]["role"] == "tool"
        await engine.shutdown()

    run(body())


def test_session_stops_at_the_templates_end_of_turn_and_n_must_be_one(tiny: Path) -> None:
    async def body() -> None:
        engine = await opened(tiny)
        session = engine.session([{"role": "user", "content": "hi"}])
        turn = await session.generate(SamplingParams(max_tokens=2))
        assert turn.completion is not None
        end = load_tokenizer(str(tiny)).convert_tokens_to_ids("<|end|>")
        requests: list[GenerateRequest] = []
        original = backend().rlinfer_generate

        async def spy(requests_: Sequence[GenerateRequest]) -> list[Completion]:
            requests.extend(requests_)
            return await original(requests_)

        backend().rlinfer_generate = spy  # type: ignore[method-assign]
        session.add_message("user", "more")
        await session.generate(SamplingParams(max_tokens=2))
        assert requests[0].sampling.stop_token_ids == (end,)
        with pytest.raises(InvalidRequest) as info:
            await session.generate(SamplingParams(n=2))
        assert info.value.field == "sampling.n"
        await engine.shutdown()

    run(body())


def test_template_that_rewrites_earlier_turns_is_reported(tiny: Path, tmp_path: Path) -> None:
    import shutil

    rewriting = tmp_path / "rewriting"
    shutil.copytree(tiny, rewriting)
    config = json.loads((rewriting / "tokenizer_config.json").read_text())
    # states the number of user turns up front: rewrites the conversation whenever a user turn is added
    config["chat_template"] = (
        "[{{ messages | selectattr('role', 'equalto', 'user') | list | length }} user turns]"
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (rewriting / "tokenizer_config.json").write_text(json.dumps(config))
    for name in ("chat_template.jinja",):
        (rewriting / name).unlink(missing_ok=True)

    async def body() -> None:
        engine = await opened(rewriting)
        strict = engine.session([{"role": "user", "content": "one"}])
        await strict.generate(SamplingParams(max_tokens=2))
        tokens = strict.token_ids
        with pytest.raises(TemplateContinuityError):
            strict.add_message("user", "two")
        assert strict.token_ids == tokens  # nothing appended
        lenient = engine.session([{"role": "user", "content": "one"}], strict=False)
        await lenient.generate(SamplingParams(max_tokens=2))
        turn = lenient.add_message("user", "two")
        assert not turn.exact and turn.note and not lenient.exact
        assert lenient.token_ids[: len(tokens)] == tokens  # never rewrites what the model saw
        await engine.shutdown()

    run(body())


def test_raw_token_session(tiny: Path) -> None:
    async def body() -> None:
        engine = await opened(tiny)
        session = engine.session(prompt_token_ids=[1, 2, 3], chat_template=False)
        turn = await session.generate(SamplingParams(max_tokens=3))
        session.add_tokens([9, 9])
        session.add_text("hello")
        second = await session.generate(SamplingParams(max_tokens=2))
        assert second.completion is not None and second.completion.prompt_token_ids[:3] == (1, 2, 3)
        assert session.result().loss_mask[turn.start : turn.end] == (1, 1, 1)
        with pytest.raises(InvalidRequest):
            session.add_message("user", "x")
        chat = engine.session([{"role": "user", "content": "x"}])
        with pytest.raises(InvalidRequest):
            chat.add_tokens([1])
        fork = chat.fork()
        await fork.generate(SamplingParams(max_tokens=2))
        assert len(chat.token_ids) < len(fork.token_ids) and chat.turns[-1].kind != "model"
        await engine.shutdown()

    run(body())


def test_score_reads_prompt_logprobs(tiny: Path) -> None:
    async def body() -> None:
        engine = await opened(tiny)
        original = backend().rlinfer_generate

        async def with_prompt_logprobs(requests: Sequence[GenerateRequest]) -> list[Completion]:
            out = await original(requests)
            return [attrs.evolve(c, prompt_logprobs=(None, *(-float(t) for t in c.prompt_token_ids[1:]))) for c in out]

        backend().rlinfer_generate = with_prompt_logprobs  # type: ignore[method-assign]
        scores = await engine.score([ScoreRequest([1, 2], [3, 4, 5]), ScoreRequest([7], [8])])
        assert [s.logprobs for s in scores] == [(-3.0, -4.0, -5.0), (-8.0,)]
        assert all(s.weight_version == 0 for s in scores)
        with pytest.raises(InvalidRequest):
            ScoreRequest([1], [])
        await engine.shutdown()

    run(body())


def test_tool_calls_are_parsed_and_checked(tiny: Path) -> None:
    async def body() -> None:
        engine = await opened(tiny)
        text = (
            'sure <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": "x"}}</tool_call><tool_call>{"name": '
        )
        found = await engine.parse_tool_calls(text, "hermes", [ADD])
        assert [c.ok for c in found.calls] == [True, False, False, False]
        assert found.calls[0].arguments == {"a": 1, "b": 2} and found.content == "sure "
        assert "unknown tool" in (found.calls[1].error or "") and "schema" in (found.calls[2].error or "")
        out = await engine.generate(GenerateRequest(prompt_token_ids=[1], tools=[ADD], tool_parser="hermes"))
        assert out[0].tool_calls is not None and out[0].tool_calls.calls == ()
        with pytest.raises(InvalidRequest) as info:
            await engine.parse_tool_calls(text, "pythonic", [ADD])
        assert info.value.field == "tool_parser"
        await engine.shutdown()

    run(body())


def test_unclaimed_agent_capabilities_raise_before_the_backend(tiny: Path) -> None:
    async def body() -> None:
        engine = await opened(tiny, supported=[Capability.STREAM.value])
        calls = len(backend().calls)
        probes = [
            GenerateRequest(prompt_token_ids=[1], tools=[ADD]),
            GenerateRequest(prompt_token_ids=[1], sampling=SamplingParams(structured={"regex": "a+"})),
            GenerateRequest(prompt_token_ids=[1], lora="x"),
        ]
        for request in probes:
            with pytest.raises(UnsupportedCapability):
                await engine.generate(request)
        with pytest.raises(UnsupportedCapability):
            await engine.score(ScoreRequest([1], [2]))
        with pytest.raises(UnsupportedCapability):
            await engine.list_loras()
        assert len(backend().calls) == calls
        assert engine.capabilities.supports(Capability.SESSIONS)  # derived: built on generate
        await engine.shutdown()

    run(body())


def test_invalid_constraints_name_their_field() -> None:
    for structured, field in [
        ({"json_schema": {"type": "objekt"}}, "structured.json_schema"),
        ({"json_schema": "{not json"}, "structured.json_schema"),
        ({"regex": "a(?=b)"}, "structured.regex"),
        ({"regex": "("}, "structured.regex"),
        ({"choice": ["a", "a"]}, "structured.choice"),
        ({"grammar": "x"}, "structured"),
    ]:
        with pytest.raises(InvalidRequest) as info:
            SamplingParams(structured=structured)
        assert info.value.field == field, structured
    with pytest.raises(InvalidRequest) as info:
        GenerateRequest(prompt_token_ids=[1], tools=[{"name": "f", "parameters": {"type": 5}}])
    assert info.value.field == "tools[0].parameters"
    ok = SamplingParams(structured={"json_schema": {"type": "object"}})
    assert ok == SamplingParams(structured={"json_schema": {"type": "object"}}) and hash(ok)
    assert ok.structured is not None and ok.structured.accepts('{"a": 1}') and not ok.structured.accepts("[1]")


def test_lora_registry_bookkeeping(tiny: Path, tmp_path: Path) -> None:
    peft = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 128)}

    async def body() -> None:
        engine = await opened(tiny)
        info = await engine.load_lora(LoraAdapter("a", tensors=tensors, config=peft))
        assert (info.rank, info.alpha, info.target_modules, info.version) == (2, 4.0, ("q_proj",), 0)
        assert (await engine.update_lora(LoraAdapter("a", tensors=tensors, config=peft))).version == 1
        with pytest.raises(InvalidRequest) as err:
            await engine.update_lora(LoraAdapter("a", tensors=tensors, config={**peft, "r": 4}))
        assert err.value.field == "lora.config"
        await engine.generate(GenerateRequest(prompt_token_ids=[1], lora="a"))
        assert [i.name for i in await engine.list_loras()] == ["a"]
        await engine.unload_lora("a")
        assert [n for n, _ in backend().calls if n.endswith("_lora")] == ["load_lora", "load_lora", "unload_lora"]
        assert backend().adapters == {}
        with pytest.raises(InvalidRequest) as err:
            await engine.generate(GenerateRequest(prompt_token_ids=[1], lora="a"))
        assert err.value.field == "lora"
        await engine.shutdown()

    run(body())
    with pytest.raises(InvalidRequest) as err:
        LoraAdapter("a", path=str(tmp_path))
    assert err.value.field == "lora.path"
    with pytest.raises(InvalidRequest):
        LoraAdapter("a", tensors={"w": torch.zeros(1)}, config=peft)
