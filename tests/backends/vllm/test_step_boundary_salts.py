"""The engine core's weight-epoch salts (rlinfer_vllm.engine_core.step_boundary) on vLLM's own
``Request`` and block hasher: a request salted with an epoch hashes its prompt's blocks as a
request created with that salt would, so it can only hit blocks of its own epoch."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm")

BLOCK = 16
PROMPT = list(range(100, 100 + 3 * BLOCK + 5))  # three full blocks and a partial one


def _request(salt: str | None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    return Request("r", list(PROMPT), SamplingParams(max_tokens=4), None, cache_salt=salt, block_hasher=hasher)


def test_an_epoch_salt_hashes_the_prompt_as_a_request_made_with_it() -> None:
    from rlinfer_vllm.engine_core.step_boundary import not_started, salt_with_epoch

    request = _request("rlinfer-abc-v3")
    before = list(request.block_hashes)
    assert len(before) == 3 and not_started(request)

    salt_with_epoch(request, 1)
    assert request.cache_salt == "rlinfer-abc-v3#w1"
    assert request.block_hashes == _request("rlinfer-abc-v3#w1").block_hashes
    assert request.block_hashes[0] != before[0]  # the salt keys the first block, the chain the rest

    salt_with_epoch(request, 2)  # a second load while it still waits: its own salt, the new epoch
    assert request.cache_salt == "rlinfer-abc-v3#w2"
    assert request.block_hashes == _request("rlinfer-abc-v3#w2").block_hashes


def test_an_unsalted_request_gets_the_epoch_alone() -> None:
    from rlinfer_vllm.engine_core.step_boundary import salt_with_epoch

    request = _request(None)
    salt_with_epoch(request, 4)
    assert request.cache_salt == "#w4"
    assert request.block_hashes == _request("#w4").block_hashes != _request(None).block_hashes


def test_a_request_with_computed_tokens_has_started() -> None:
    from rlinfer_vllm.engine_core.step_boundary import not_started

    request = _request("s")
    request.num_computed_tokens = BLOCK
    assert not not_started(request)
