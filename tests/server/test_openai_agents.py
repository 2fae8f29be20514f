"""The OpenAI surface agents and trainers use, with the ``openai`` package and httpx against
``rlinfer serve`` on the real engine (issue 25, part 1): tools, tool-call history, parsed tool
calls, response_format / structured_outputs, vLLM's token fields, chat templates, and the
tokenizer routes. The tiny random model calls no tool by itself: outputs are forced through
structured output, and the server reads them back with the engine's own parser."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from conftest import MODEL_NAME, Served

#: small schemas: the tiny byte-level tokenizer spends ~110 tokens per tool in the template's tool
#: section, and the test engine's context is 512 tokens
ARGS = {
    "type": "object",
    "properties": {"a": {"enum": [1, 2, 3]}, "b": {"enum": [1, 2, 3]}},
    "required": ["a", "b"],
}
ADD = {"type": "function", "function": {"name": "add", "parameters": ARGS}}
MUL = {"type": "function", "function": {"name": "mul", "parameters": ARGS}}
#: the hermes call the regex forces (the tiny byte-level tokenizer spends ~70 tokens on it)
CALL_TEXT = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
CALL_REGEX = CALL_TEXT.replace("{", r"\{").replace("}", r"\}")
USER = [{"role": "user", "content": "2+3?"}]


def _tokenizer(server: Served) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server.base_model)


def _capabilities(server: Served) -> set[str]:
    info = httpx.get(f"{server.url}/control/info", headers=server.control_headers, timeout=60).json()
    return set(info["capabilities"]["supported"])


def _post(server: Served, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120.0)


def test_tools_auto_reads_the_call_with_the_engine_parser(client, server: Served) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        tools=[ADD],
        max_tokens=160,
        temperature=0,
        extra_body={"structured_outputs": {"regex": CALL_REGEX}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert choice.message.content is None
    # the tools were rendered in the template's tool section, as /tokenize renders them
    tokens = _post(server, "/tokenize", {"model": MODEL_NAME, "messages": USER, "tools": [ADD]}).json()
    assert choice.model_extra["prompt_token_ids"] == tokens["tokens"] == out.model_extra["prompt_token_ids"]
    text = _tokenizer(server).decode(choice.model_extra["token_ids"], skip_special_tokens=True)
    assert text == CALL_TEXT, "token ids stay the raw output"


def test_tool_choice_none_answers_plain_content(client) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        tools=[ADD],
        tool_choice="none",
        max_tokens=160,
        extra_body={"structured_outputs": {"regex": CALL_REGEX}},
    )
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.message.content == CALL_TEXT
    assert choice.finish_reason == "stop"


def test_tool_call_history_is_rendered_by_the_chat_template(client, server: Served) -> None:
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    out = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=[ADD], max_tokens=4, temperature=0)
    tok = _tokenizer(server)
    expected_messages = [
        {"role": "user", "content": USER[0]["content"]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    # tools reach the template in the core's ToolSpec.to_openai() form (description "" when none)
    tools = [{"type": "function", "function": {"name": "add", "description": "", "parameters": ARGS}}]
    text = tok.apply_chat_template(expected_messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    ids = tok.encode(text, add_special_tokens=False)
    assert out.choices[0].model_extra["prompt_token_ids"] == ids
    rendered = _post(server, "/v1/chat/completions/render", {"model": MODEL_NAME, "messages": history, "tools": [ADD]})
    assert rendered.status_code == 200, rendered.text
    assert rendered.json()["token_ids"] == ids


def test_named_and_required_tool_choice_constrain_the_call(client) -> None:
    named = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        tools=[ADD, MUL],
        tool_choice={"type": "function", "function": {"name": "mul"}},
        max_tokens=120,
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "mul"
    jsonschema.validate(json.loads(call.function.arguments), ARGS)
    required = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        tools=[ADD, MUL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=160,
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name in ("add", "mul")
    jsonschema.validate(json.loads(call.function.arguments), ARGS)


def test_streamed_tool_call_arrives_in_the_last_chunk(client) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": USER,
        "tools": [ADD],
        "max_tokens": 160,
        "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": CALL_REGEX}},
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    ids = [t for c in chunks for t in c.choices[0].model_extra["token_ids"]]
    assert ids == whole.model_extra["token_ids"]
    calls = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or ()]
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "add", {"a": 2, "b": 3})
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)


def test_response_format_json_schema_and_structured_outputs(client) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
        "required": ["answer", "ok"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        max_tokens=64,
    )
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)
    choice = client.completions.create(
        model=MODEL_NAME,
        prompt="Question: red or green?",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert choice.choices[0].text in ("red", "green")
    regex = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=16, extra_body={"structured_outputs": {"regex": "(yes|no), [0-9]"}}
    )
    assert regex.choices[0].message.content in {f"{w}, {d}" for w in ("yes", "no") for d in range(10)}


def test_response_format_json_object_is_a_json_object(client) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, response_format={"type": "json_object"}, max_tokens=96
    )
    choice = out.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # the random model may still be inside the object at max_tokens
        assert choice.message.content.startswith("{")


def test_tokens_as_token_ids(client) -> None:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt=[5, 17, 42],
        max_tokens=5,
        temperature=0,
        logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )
    choice = out.choices[0]
    ids = choice.model_extra["token_ids"]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    for token, alts in zip(ids, choice.logprobs.top_logprobs, strict=True):
        assert all(k.startswith("token_id:") for k in alts) and max(alts, key=alts.get) == f"token_id:{token}"
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=USER,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].model_extra["token_ids"]]
    assert all(alt.token.startswith("token_id:") for c in content for alt in c.top_logprobs)


def test_prompt_logprobs_are_the_teacher_forced_logprobs(client, server: Served) -> None:
    if "generate.prompt_logprobs" not in _capabilities(server):
        pytest.skip("the backend does not claim generate.prompt_logprobs")
    prompt = [5, 17, 42, 99]
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0).choices[0]
    token, logprob = first.model_extra["token_ids"][0], first.model_extra["token_logprobs"][0]
    scored = client.completions.create(
        model=MODEL_NAME, prompt=[*prompt, token], max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    ).choices[0]
    rows = scored.model_extra["prompt_logprobs"]
    assert len(rows) == len(prompt) + 1 and rows[0] is None
    assert [next(iter(r)) for r in rows[1:]] == [str(t) for t in [*prompt[1:], token]]
    assert rows[-1][str(token)]["logprob"] == pytest.approx(logprob, abs=1e-4)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    assert len(chat.model_extra["prompt_logprobs"]) == len(chat.model_extra["prompt_token_ids"])


def test_chat_template_and_kwargs_from_the_request(client, server: Served) -> None:
    template = (
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if greeting %}{{ greeting }}{% endif %}"
    )
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=2,
        temperature=0,
        extra_body={
            "chat_template": template,
            "chat_template_kwargs": {"greeting": " hi!"},
            "return_prompt_text": True,
        },
    )
    assert out.model_extra["prompt_text"] == "[user]hello hi!"
    assert out.model_extra["prompt_token_ids"] == _tokenizer(server).encode("[user]hello hi!", add_special_tokens=False)


def test_tokenize_detokenize_and_render(client, server: Served) -> None:
    tok = _tokenizer(server)
    r = _post(server, "/tokenize", {"model": MODEL_NAME, "prompt": "hello there", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("hello there") and r["count"] == len(r["tokens"])
    assert r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"]) and r["max_model_len"] > 0
    assert _post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    chat = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=2, temperature=0)
    rendered = _post(server, "/v1/chat/completions/render", {"model": MODEL_NAME, "messages": USER, "max_tokens": 2})
    body = rendered.json()
    assert body["token_ids"] == chat.model_extra["prompt_token_ids"]
    assert body["sampling_params"]["max_tokens"] == 2 and body["request_id"].startswith("chatcmpl-")
    items = _post(server, "/v1/completions/render", {"model": MODEL_NAME, "prompt": ["a", "b"]}).json()
    assert [i["token_ids"] for i in items] == [tok.encode("a"), tok.encode("b")]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/chat/completions", {"messages": USER, "tools": []}, "tools"),
        ("/v1/chat/completions", {"messages": USER, "tool_choice": "auto"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].parameters",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "json_schema"}},
            "response_format.json_schema",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "structured_outputs": {"grammar": "x"}},
            "structured_outputs.grammar",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "chat_template_kwargs": {"tokenize": True}},
            "chat_template_kwargs",
        ),
        ("/v1/chat/completions", {"messages": USER, "chat_template": "{{ raise_exception('no') }}"}, "chat_template"),
        ("/v1/chat/completions", {"messages": USER, "use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {"messages": USER, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": USER, "~tools": []}, "~tools"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "~x": 1}]}, "messages.0.~x"),
        ("/v1/completions", {"prompt": [5], "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]},
            "messages.0.function_call",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages.0.tool_calls",
        ),
        ("/detokenize", {"tokens": [10**7]}, "tokens"),
        ("/tokenize", {"prompt": "x", "~x": 1}, "~x"),
    ],
)
def test_bad_agent_requests_name_the_field(server: Served, path: str, body: dict[str, Any], param: str) -> None:
    r = _post(server, path, {"model": MODEL_NAME, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert server.alive()


def test_vllm_clients_neutral_fields_are_accepted(server: Served) -> None:
    """The fields vLLM-speaking clients send at their defaults (AReaL's and TRL's payloads)."""
    body = {
        "model": MODEL_NAME,
        "prompt": [5, 6, 7],
        "max_tokens": 3,
        "temperature": 0,
        "use_beam_search": False,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "logprobs": 0,
        "echo": False,
        "priority": 0,
        "truncate_prompt_tokens": None,
        "add_special_tokens": False,
        "spaces_between_special_tokens": True,
        "stream": False,
    }
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")


def test_unknown_request_chat_template_is_refused_without_trust(server: Served) -> None:
    from rlinfer_core.errors import InvalidRequest
    from rlinfer_server.chat_render import render_chat
    from rlinfer_server.schemas import ChatTemplateFields

    body = ChatTemplateFields.model_validate({"messages": USER, "chat_template": "{{ messages }}"})
    with pytest.raises(InvalidRequest) as info:
        render_chat(_tokenizer(server), body, None, trust_request_template=False, max_model_len=None)
    assert info.value.field == "chat_template"


def test_openai_errors_for_tools(client) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=USER,
            tools=[ADD],
            tool_choice="required",
            stream=True,
            max_tokens=2,
            response_format={"type": "json_object"},
        )
    assert info.value.body["param"] == "response_format"
