"""The batch endpoint's items straight through the server's engine client (vLLM 0.26).

vLLM 0.26's token endpoint answers without what rlinfer reads from 0.32's: no token ids or ranks
in ``top_logprobs``, no ``stop_reason``, no per-token weight-version spans (0.26 has no
``/update_weight_version`` either). On such a server :mod:`rlinfer_vllm.api_server.batch_route`
runs each item here instead: the item's body is validated by vLLM's own ``GenerateRequest``, the
request goes to ``app.state.engine_client.generate`` under the id the token endpoint would give it
(``generate-tokens-<request_id>``, so ``/abort_requests`` reaches it), and the answer is written
in 0.32's shape from the engine's ``RequestOutput`` (so the client reads one shape).

Weight versions: the API server's engine client counts every step's tokens with
:class:`rlinfer_vllm.versions.TokenVersions` (exactly as the in-process backend does), labelled
with the version that rlinfer posts to :data:`VERSION_PATH` while the scheduler is paused.

Which path runs is decided by feature, not version string: a vLLM whose ``vllm.outputs`` has no
``WeightVersionSpan`` takes this one; ``RLINFER_VLLM_BATCH_ENGINE=1`` in the server's environment
forces it (tests run it on vLLM 0.32). This module runs in the server process.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rlinfer_vllm import token_endpoint
from rlinfer_vllm.token_endpoint import CLAMPED, ID_PREFIX

#: rlinfer's weight-version label route (served only where this path runs; else 404)
VERSION_PATH = "/rlinfer/v1/weight_version"
#: what this server's vLLM offers (GET; served by the batch middleware on every vLLM)
FEATURES_PATH = "/rlinfer/v1/features"
#: set to "1" in the server's environment to force this path
FORCE_ENV = "RLINFER_VLLM_BATCH_ENGINE"


def active() -> bool:
    """Whether the batch items go through the engine client here (this vLLM's token endpoint
    reports no weight-version spans, or :data:`FORCE_ENV` asks for it)."""
    if os.environ.get(FORCE_ENV) == "1":
        return True
    import vllm.outputs

    return not hasattr(vllm.outputs, "WeightVersionSpan")


def features(app: Any) -> dict[str, Any]:
    """What the server's vLLM offers, looked up in the server process: whether the batch items go
    through the engine client (and tokens are labelled through :data:`VERSION_PATH` instead of
    ``/update_weight_version``), whether its requests take a ``cache_salt`` (0.26 and 0.32 do),
    whether vLLM's token endpoint reports weight-version spans (0.32), and whether
    ``/release_kv_cache_memory`` exists (vLLM 0.32)."""
    import vllm.outputs
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    engine = app.state.engine_client
    return {
        "batch_via_engine": active(),
        "cache_salt": "cache_salt" in GenerateRequest.model_fields,
        "token_version_spans": hasattr(vllm.outputs, "WeightVersionSpan"),
        "release_kv_cache_memory": callable(getattr(engine, "release_kv_cache_memory", None)),
    }


#: counted samples kept before the ones of other routes' requests are dropped
PRUNE_AT = 4096


def token_versions(app: Any) -> Any:
    """The app's :class:`~rlinfer_vllm.versions.TokenVersions` (installed on first use)."""
    versions = getattr(app.state, "rlinfer_versions", None)
    if versions is None:
        from rlinfer_vllm.versions import TokenVersions

        class Watched(TokenVersions):  # type: ignore[misc,unused-ignore]
            """Token versions that forget the samples of requests this route did not start (the
            token endpoint's streams, /v1/completions), which nobody takes."""

            def __init__(self, llm: Any) -> None:
                super().__init__(llm)
                self.watched: set[str] = set()

            def prune(self) -> None:
                if len(self._runs) > PRUNE_AT:
                    for key in [k for k in self._runs if k[0] not in self.watched]:
                        self._runs.pop(key, None)
                        self._taken.pop(key, None)

        versions = Watched(app.state.engine_client)
        app.state.rlinfer_versions = versions
    return versions


def set_version(app: Any, body: Mapping[str, Any]) -> dict[str, Any]:
    """Label the tokens of every later step with ``body["new_version"]`` (an integer)."""
    version = int(body["new_version"])
    token_versions(app).version = version
    return {"version": version}


def _lp(value: float) -> float:
    return CLAMPED if math.isnan(value) else max(float(value), CLAMPED)


def _spans(stamps: Sequence[int]) -> list[dict[str, int]]:
    spans: list[dict[str, int]] = []
    for i, version in enumerate(stamps):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans


def _compact_logprobs(token_ids: Sequence[int], rows: Any, with_top: bool) -> dict[str, Any]:
    """A choice's logprobs in the batch route's compact shape (see :func:`compact`)."""
    if rows is None:
        return {}
    sampled: list[float] = []
    top: list[list[list[Any]]] = []
    for token, row in zip(token_ids, rows, strict=False):
        row = row or {}
        entry = row.get(token)
        sampled.append(_lp(entry.logprob) if entry is not None else CLAMPED)
        if with_top:
            top.append([[int(t), _lp(lp.logprob), lp.rank] for t, lp in row.items()])
    return {"lp": sampled, "top": top} if with_top else {"lp": sampled}


def compact(answer: dict[str, Any], with_top: bool) -> dict[str, Any]:
    """The token endpoint's answer with each choice's logprobs in the batch route's compact shape
    (:func:`rlinfer_vllm.token_endpoint.compact_logprobs`), which the client reads as well as
    the token endpoint's own. For 128 x 512 tokens, building, encoding, decoding and converting the
    per-token dicts took 0.97 s on 2 CPU cores, all after the last token; compact: 0.11 s
    (dev/bench/vllm_server_answer_bench.py). On an H100, server mode lagged in-process by 0.65 s a
    run of that batch (0.937 of its tok/s)."""
    for choice in answer.get("choices") or ():
        choice.update(token_endpoint.compact_logprobs(choice, with_top))
        choice.pop("logprobs", None)
    return answer


def answer(request_id: str, engine_id: str, final: Any, versions: Any, with_top: bool) -> dict[str, Any]:
    """0.32's token-endpoint answer for the engine's last ``RequestOutput`` (None: aborted before
    any output), each choice with its tokens' weight-version spans, its logprobs already in the
    batch route's compact shape (:func:`compact`)."""
    if final is None:
        return {"request_id": request_id, "choices": []}
    choices = []
    for out in sorted(final.outputs, key=lambda o: o.index):
        tokens = [int(t) for t in out.token_ids]
        choices.append(
            {
                "index": int(out.index),
                "token_ids": tokens,
                **_compact_logprobs(tokens, out.logprobs, with_top),
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
                "weight_versions": _spans(versions.take(engine_id, out.index, len(tokens))),
            }
        )
    prompt = None
    if final.prompt_logprobs is not None:
        prompt = [
            None if row is None else {str(t): {"logprob": _lp(lp.logprob), "rank": lp.rank} for t, lp in row.items()}
            for row in final.prompt_logprobs
        ]
    return {"request_id": request_id, "choices": choices, "prompt_logprobs": prompt}


async def generate(app: Any, request: Any) -> dict[str, Any]:
    """Run one validated ``GenerateRequest`` (``stream`` false) to its end; its answer.

    Cancelling the caller cancels the engine generator, which aborts the request in the engine.
    """
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind

    engine = app.state.engine_client
    if engine.errored:
        raise engine.dead_error
    from vllm.exceptions import VLLMValidationError

    params = request.sampling_params
    max_num_seqs = engine.vllm_config.scheduler_config.max_num_seqs
    if params.n > max_num_seqs:  # as the token endpoint refuses it
        raise VLLMValidationError(
            f"sampling_params.n must be at most the server's max_num_seqs ({max_num_seqs}), got {params.n}.",
            parameter="n",
        )
    versions = token_versions(app)
    params.output_kind = RequestOutputKind.FINAL_ONLY
    engine_id = f"{ID_PREFIX}{request.request_id}"
    final = None
    versions.watched.add(engine_id)
    try:
        async for out in engine.generate(
            tokens_input(list(request.token_ids), cache_salt=request.cache_salt), params, engine_id
        ):
            final = out
        return answer(request.request_id, engine_id, final, versions, with_top=bool(params.logprobs))
    finally:
        versions.watched.discard(engine_id)
        versions.forget(engine_id, max(int(params.n), 1))
        versions.prune()


__all__ = [
    "FEATURES_PATH",
    "FORCE_ENV",
    "VERSION_PATH",
    "active",
    "answer",
    "compact",
    "features",
    "generate",
    "set_version",
    "token_versions",
]
