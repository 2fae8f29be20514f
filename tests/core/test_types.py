"""Contract types: valid values round-trip, invalid ones raise InvalidRequest naming the field."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import (
    Capabilities,
    Capability,
    ChatMessage,
    EngineConfig,
    GenerateRequest,
    SamplingParams,
)
from rlinfer_core.weights import BroadcastGroup, CheckpointDir, TensorSpec, WeightUpdate
from rlinfer_core.wire import from_wire, to_wire

finite = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def sampling_params(draw: st.DrawFn) -> SamplingParams:
    max_tokens = draw(st.integers(1, 1_000_000))
    return SamplingParams(
        temperature=draw(st.floats(0.0, 100.0)),
        top_p=draw(st.floats(0.0, 1.0, exclude_min=True)),
        top_k=draw(st.one_of(st.just(-1), st.integers(1, 1_000_000))),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        n=draw(st.integers(1, 256)),
        seed=draw(st.none() | st.integers(0, 2**31 - 1)),
        stop_token_ids=draw(st.lists(st.integers(0, 2**63 - 1), max_size=4)),
        stop=draw(st.lists(st.text(min_size=1, max_size=5), max_size=3)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.integers(0, 20)),
        prompt_logprobs=draw(st.booleans()),
    )


messages = st.lists(
    st.builds(ChatMessage, role=st.sampled_from(["system", "user", "assistant", "tool"]), content=st.text(max_size=20)),
    min_size=1,
    max_size=3,
)


@st.composite
def generate_requests(draw: st.DrawFn) -> GenerateRequest:
    sampling = draw(sampling_params())
    rid = draw(st.text(min_size=1, max_size=12))
    if draw(st.booleans()):
        return GenerateRequest(
            prompt_token_ids=draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=8)),
            sampling=sampling,
            request_id=rid,
        )
    return GenerateRequest(messages=draw(messages), sampling=sampling, request_id=rid)


engine_configs = st.builds(
    EngineConfig,
    model=st.text(min_size=1, max_size=20),
    tokenizer=st.none() | st.text(min_size=1, max_size=10),
    dtype=st.sampled_from(["auto", "float32", "bfloat16", "float16"]),
    seed=st.integers(0, 2**31 - 1),
    device=st.sampled_from(["auto", "cpu", "cuda"]),
    tensor_parallel_size=st.integers(1, 1024),
    data_parallel_size=st.integers(1, 1024),
    max_model_len=st.none() | st.integers(16, 10_000_000),
    max_num_seqs=st.none() | st.integers(1, 1_000_000),
    kv_cache_memory_bytes=st.none() | st.integers(1 << 20, 1 << 50),
    gpu_memory_utilization=st.none() | st.floats(0.0, 1.0, exclude_min=True),
    enable_prefix_caching=st.booleans(),
    enable_memory_release=st.booleans(),
    enforce_eager=st.booleans(),
    request_timeout_s=st.floats(0.0, 86400.0, exclude_min=True),
    startup_timeout_s=st.floats(0.0, 86400.0, exclude_min=True),
    engine_kwargs=st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5), max_size=3),
)

broadcast_groups = st.builds(
    BroadcastGroup,
    master_addr=st.text(min_size=1, max_size=15),
    master_port=st.integers(1, 65535),
    world_size=st.integers(2, 65536),
    backend=st.sampled_from(["gloo", "nccl"]),
    group_name=st.text(min_size=1, max_size=10),
    timeout_s=st.floats(0.0, 3600.0, exclude_min=True),
)

capabilities = st.builds(
    Capabilities,
    backend=st.text(max_size=8),
    engine_version=st.text(max_size=8),
    platform=st.sampled_from(["cpu", "cuda"]),
    supported=st.frozensets(st.sampled_from(list(Capability))),
    notes=st.dictionaries(st.sampled_from([c.value for c in Capability]), st.text(max_size=10), max_size=3),
)

ALL_VALID = st.one_of(sampling_params(), generate_requests(), engine_configs, broadcast_groups, capabilities)


@settings(max_examples=150, deadline=None)
@given(ALL_VALID)
def test_valid_values_round_trip_through_the_wire_format(obj: Any) -> None:
    data = to_wire(obj)
    text = json.dumps(data)  # really JSON-ready
    back = from_wire(json.loads(text), type(obj))
    assert back == obj
    assert type(back) is type(obj)


@settings(max_examples=100, deadline=None)
@given(st.one_of(sampling_params(), engine_configs, broadcast_groups))
def test_valid_values_round_trip_through_asdict(obj: Any) -> None:
    rebuilt = type(obj)(**attrs.asdict(obj, recurse=False))
    assert rebuilt == obj


@settings(max_examples=50, deadline=None)
@given(generate_requests())
def test_generate_request_round_trips_through_asdict(request: GenerateRequest) -> None:
    d = attrs.asdict(request, recurse=True)
    d["sampling"] = SamplingParams(**d["sampling"])
    assert GenerateRequest(**d) == request


def test_lists_are_converted_to_tuples_and_dict_messages_accepted() -> None:
    r = GenerateRequest(messages=[{"role": "user", "content": "hi"}], sampling=SamplingParams(stop=["x"]))
    assert r.messages == (ChatMessage("user", "hi"),)
    assert r.sampling.stop == ("x",)
    assert GenerateRequest(prompt_token_ids=[1, 2]).prompt_token_ids == (1, 2)


# (class, field, bad value, text the message must contain: the allowed range)
BAD_FIELDS: list[tuple[type, str, Any, str]] = [
    (SamplingParams, "temperature", -0.1, ">= 0.0 and <= 100.0"),
    (SamplingParams, "temperature", 100.5, ">= 0.0 and <= 100.0"),
    (SamplingParams, "temperature", math.nan, "NaN"),
    (SamplingParams, "temperature", "hot", "a number"),
    (SamplingParams, "top_p", 0.0, "> 0.0 and <= 1.0"),
    (SamplingParams, "top_p", 1.01, "> 0.0 and <= 1.0"),
    (SamplingParams, "top_k", 0, "-1 (disabled) or >= 1"),
    (SamplingParams, "top_k", -2, ">= -1"),
    (SamplingParams, "top_k", 2.5, "an integer"),
    (SamplingParams, "max_tokens", 0, ">= 1"),
    (SamplingParams, "max_tokens", True, "an integer"),
    (SamplingParams, "min_tokens", -1, ">= 0"),
    (SamplingParams, "min_tokens", 17, "<= max_tokens (16)"),
    (SamplingParams, "n", 0, ">= 1 and <= 256"),
    (SamplingParams, "n", 257, ">= 1 and <= 256"),
    (SamplingParams, "seed", -1, ">= 0 and <= 2147483647"),
    (SamplingParams, "seed", 2**31, ">= 0 and <= 2147483647"),
    (SamplingParams, "stop_token_ids", [1, -1], "integer in [0, "),
    (SamplingParams, "stop_token_ids", [1.5], "integer in [0, "),
    (SamplingParams, "stop", [""], "non-empty string"),
    (SamplingParams, "stop", [3], "non-empty string"),
    (SamplingParams, "ignore_eos", "yes", "a bool"),
    (SamplingParams, "logprobs", 21, ">= 0 and <= 20"),
    (SamplingParams, "logprobs", -1, ">= 0 and <= 20"),
    (SamplingParams, "prompt_logprobs", 1, "a bool"),
    (EngineConfig, "model", "", "model directory or name"),
    (EngineConfig, "model", 3, "a string"),
    (EngineConfig, "dtype", "int8", "'auto', 'float32', 'bfloat16', 'float16'"),
    (EngineConfig, "seed", -1, ">= 0"),
    (EngineConfig, "device", "tpu", "'auto', 'cpu', 'cuda'"),
    (EngineConfig, "tensor_parallel_size", 0, ">= 1 and <= 1024"),
    (EngineConfig, "data_parallel_size", 0, ">= 1 and <= 1024"),
    (EngineConfig, "max_model_len", 15, ">= 16"),
    (EngineConfig, "max_num_seqs", 0, ">= 1"),
    (EngineConfig, "kv_cache_memory_bytes", 1000, f">= {1 << 20}"),
    (EngineConfig, "gpu_memory_utilization", 0.0, "> 0.0 and <= 1.0"),
    (EngineConfig, "gpu_memory_utilization", 1.5, "> 0.0 and <= 1.0"),
    (EngineConfig, "request_timeout_s", 0.0, "> 0.0 and <= 86400.0"),
    (EngineConfig, "startup_timeout_s", -5.0, "> 0.0 and <= 86400.0"),
    (BroadcastGroup, "master_port", 0, ">= 1 and <= 65535"),
    (BroadcastGroup, "master_port", 65536, ">= 1 and <= 65535"),
    (BroadcastGroup, "world_size", 1, ">= 2 and <= 65536"),
    (BroadcastGroup, "backend", "mpi", "'gloo', 'nccl'"),
    (BroadcastGroup, "timeout_s", 0.0, "> 0.0 and <= 3600.0"),
    (BroadcastGroup, "timeout_s", 3601.0, "> 0.0 and <= 3600.0"),
]

REQUIRED: dict[type, dict[str, Any]] = {
    SamplingParams: {},
    EngineConfig: {"model": "m"},
    BroadcastGroup: {"master_addr": "127.0.0.1", "master_port": 29500},
}


@pytest.mark.parametrize(
    ("cls", "field", "value", "allowed"), BAD_FIELDS, ids=[f"{c.__name__}.{f}={v!r}" for c, f, v, _ in BAD_FIELDS]
)
def test_invalid_field_raises_invalid_request_naming_field_and_range(
    cls: type, field: str, value: Any, allowed: str
) -> None:
    kwargs = {**REQUIRED[cls], field: value}
    with pytest.raises(InvalidRequest) as info:
        cls(**kwargs)
    assert info.value.field == field
    assert allowed in str(info.value)
    assert field in str(info.value)


WIRE_BAD_FIELDS = [case for case in BAD_FIELDS if not (isinstance(case[2], float) and math.isnan(case[2]))]


@pytest.mark.parametrize(("cls", "field", "value", "allowed"), WIRE_BAD_FIELDS)
def test_invalid_field_arriving_over_the_wire_is_rejected_the_same_way(
    cls: type, field: str, value: Any, allowed: str
) -> None:
    data = to_wire(cls(**REQUIRED[cls]))
    data[field] = value
    with pytest.raises(InvalidRequest) as info:
        from_wire(data, cls)
    assert info.value.field == field
    assert allowed in str(info.value)


def test_wire_missing_key_names_the_field() -> None:
    data = to_wire(BroadcastGroup("h", 1))
    del data["master_addr"]
    with pytest.raises(InvalidRequest) as info:
        from_wire(data, BroadcastGroup)
    assert info.value.field == "master_addr"


def test_wire_does_not_coerce_strings() -> None:
    data = to_wire(SamplingParams())
    data["max_tokens"] = "16"
    with pytest.raises(InvalidRequest) as info:
        from_wire(data, SamplingParams)
    assert info.value.field == "max_tokens"


@pytest.mark.parametrize(
    ("kwargs", "field", "text"),
    [
        ({}, "prompt_token_ids", "exactly one of"),
        ({"prompt_token_ids": [1], "messages": [ChatMessage("user", "x")]}, "prompt_token_ids", "exactly one of"),
        ({"prompt_token_ids": []}, "prompt_token_ids", "at least one token"),
        ({"prompt_token_ids": [1, -3]}, "prompt_token_ids", "item 1 must be an integer in [0, "),
        ({"prompt_token_ids": ["a"]}, "prompt_token_ids", "item 0"),
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": [{"role": "user"}]}, "messages", "item 0 must be {'role','content'}"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "role", "one of ['system', 'user', 'assistant', 'tool']"),
        ({"messages": [{"role": "user", "content": 5}]}, "content", "a string"),
        ({"prompt_token_ids": [1], "request_id": ""}, "request_id", "non-empty string"),
        ({"prompt_token_ids": [1], "request_id": 7}, "request_id", "non-empty string"),
        ({"prompt_token_ids": [1], "sampling": {"n": 2}}, "sampling", "a SamplingParams"),
    ],
)
def test_invalid_generate_request(kwargs: dict[str, Any], field: str, text: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        GenerateRequest(**kwargs)
    assert info.value.field == field
    assert text in str(info.value)


def test_invalid_weight_update_fields() -> None:
    with pytest.raises(InvalidRequest) as info:
        WeightUpdate(CheckpointDir("/x"), version=-1)
    assert info.value.field == "version"
    with pytest.raises(InvalidRequest) as info:
        WeightUpdate(TensorSpec("a", "float32", (1,)))  # type: ignore[arg-type]
    assert info.value.field == "source"


@settings(max_examples=50, deadline=None)
@given(st.floats(allow_nan=False).filter(lambda x: not 0.0 <= x <= 100.0))
def test_temperature_out_of_range_always_rejected(value: float) -> None:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(temperature=value)
    assert info.value.field == "temperature"


def test_capabilities_require_and_to_dict() -> None:
    caps = Capabilities("b", "1.0", "cpu", {Capability.CHAT}, {Capability.STREAM.value: "no streaming here"})
    caps.require(Capability.CHAT)
    with pytest.raises(Exception) as info:
        caps.require(Capability.STREAM)
    assert "no streaming here" in str(info.value)
    d = caps.to_dict()
    assert d["supported"] == ["generate.chat"]
    assert set(d["unsupported"]) == {c.value for c in Capability} - {"generate.chat"}
