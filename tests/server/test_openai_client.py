"""The ``openai`` package against ``rlinfer serve`` on a real engine."""

from __future__ import annotations

import httpx
from conftest import MODEL_NAME, Served

PROMPT = [5, 17, 42, 99, 7, 12]


def test_models_lists_the_served_model(client, server: Served) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_returns_token_ids_logprobs_and_versions(client, server: Served) -> None:
    version = httpx.get(f"{server.url}/control/weight_version", headers=server.control_headers).json()
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    choice = out.choices[0]
    extra = choice.model_extra
    assert len(extra["token_ids"]) == out.usage.completion_tokens > 0
    assert extra["prompt_token_ids"] == PROMPT and out.usage.prompt_tokens == len(PROMPT)
    assert len(extra["token_logprobs"]) == len(extra["token_ids"])
    assert choice.logprobs.token_logprobs == extra["token_logprobs"]
    assert all(lp <= 0.0 for lp in extra["token_logprobs"])
    assert all(len(alt) >= 1 for alt in choice.logprobs.top_logprobs)
    # greedy: the sampled token is the most likely alternative
    for token, alts in zip(extra["token_ids"], choice.logprobs.model_extra["top_logprobs_ids"], strict=True):
        assert max(alts, key=alts.get) == str(token)
    assert extra["token_versions"] == [version["weight_version"]] * len(extra["token_ids"])
    assert out.model_extra["weight_version"] == version["weight_version"]


def test_text_prompts_and_n(client) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt=["hello there", "Question:"], max_tokens=4, n=2, seed=3)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert all(len(c.model_extra["token_ids"]) == 4 or c.finish_reason == "stop" for c in out.choices)
    assert out.choices[0].model_extra["prompt_token_ids"] != out.choices[2].model_extra["prompt_token_ids"]


def test_stream_concatenates_to_the_batch_result(client) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 0}
    whole = client.completions.create(**kwargs).choices[0]
    ids: list[int] = []
    logprobs: list[float] = []
    text = ""
    finish = None
    for chunk in client.completions.create(stream=True, **kwargs):
        c = chunk.choices[0]
        ids += c.model_extra["token_ids"]
        logprobs += c.model_extra["token_logprobs"]
        text += c.text
        finish = c.finish_reason or finish
    assert ids == whole.model_extra["token_ids"]
    assert logprobs == whole.model_extra["token_logprobs"]
    assert text == whole.text and finish == whole.finish_reason


def test_chat_with_logprobs(client) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    ids = choice.model_extra["token_ids"]
    assert [t.model_extra["token_id"] for t in choice.logprobs.content] == ids
    assert [t.logprob for t in choice.logprobs.content] == choice.model_extra["token_logprobs"]
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert choice.model_extra["prompt_token_ids"]  # the template was applied by the engine


def test_chat_stream(client) -> None:
    kwargs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    roles = [c.choices[0].delta.role for c in chunks if c.choices]
    assert roles[0] == "assistant"
    ids = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert ids == whole.model_extra["token_ids"]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert chunks[-1].usage.completion_tokens == len(ids)


def test_errors_are_openai_errors(client) -> None:
    import openai
    import pytest

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=[10**6], max_tokens=4)
    assert info.value.body["param"] == "prompt_token_ids"
