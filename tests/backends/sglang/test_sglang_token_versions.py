"""TokenVersions.of, built a run at a time, gives every token the version of the last update whose
boundary it reached (the per-token rule, spelled out here as the oracle)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from rlinfer_sglang.versions import TokenVersions

boundaries = st.one_of(st.integers(min_value=0, max_value=40), st.just(math.inf))


def per_token(base: int, marks: list[tuple[float, int]], count: int, start: int) -> tuple[int, ...]:
    out = []
    for i in range(start, count):
        version = base
        for boundary, new in marks:
            if i >= boundary:
                version = new
        out.append(version)
    return tuple(out)


@given(
    marks=st.lists(st.tuples(boundaries, st.integers(min_value=1, max_value=9)), max_size=5),
    count=st.integers(min_value=0, max_value=40),
    start=st.integers(min_value=0, max_value=40),
)
def test_versions_match_the_per_token_rule(marks: list[tuple[float, int]], count: int, start: int) -> None:
    versions = TokenVersions()
    versions.admit("rid")
    versions._marks["rid"] = list(marks)
    assert versions.of("rid", count, start) == per_token(0, marks, count, start)


def test_an_update_mid_sample_splits_its_tokens() -> None:
    versions = TokenVersions()
    versions.admit("a")
    versions.admit("b")
    versions.loaded(1, ["a", "b"], dispatched={"a"}, lengths={"a": 3})
    assert versions.of("a", 5) == (0, 0, 0, 1, 1)
    assert versions.of("b", 2) == (1, 1)  # not dispatched before the update: all new weights
    assert versions.of("a", 5, start=4) == (1,)


def test_cache_keys_name_the_version_and_keep_what_sglang_appends() -> None:
    from rlinfer_sglang.requests import cache_key, rekeyed

    assert cache_key(3) == "rlinfer-v3;"
    lora_id = "0abc"  # SGLang's Req appends a LoRA id to the key
    assert rekeyed(cache_key(1) + lora_id, cache_key(10)) == "rlinfer-v10;0abc"
    assert rekeyed(cache_key(1), cache_key(2)) == cache_key(2)
    assert rekeyed(None, cache_key(2)) is None  # not rlinfer's (a raw baseline): left alone
    assert rekeyed("caller-key", cache_key(2)) == "caller-key"
