"""rlinfer requests to SGLang's ``/generate`` bodies, and per-token weight versions back.

The body is SGLang's ``GenerateReqInput`` as JSON, built exactly as the in-process backend builds
the object (:mod:`rlinfer_sglang.convert`: sampling parameters, logprob arguments, rlinfer's
serialized logits processor when a request needs it). SGLang answers with the same output dicts
the in-process tokenizer manager returns (``text``, ``output_ids``, ``meta_info``), so
:func:`rlinfer_sglang.convert.completion` / ``delta`` read them unchanged.

Weight versions: SGLang's scheduler (0.5.2x) keeps, per request, the output length at every
weight-version label change and reports a finished request's tokens as spans per label
(``meta_info["weight_versions"]``); the backend sets the label to rlinfer's version number while
nothing runs (see :mod:`rlinfer_sglang.server_mode.weights`), so :func:`expand_versions` gives
each token the version that computed it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlinfer_core.types import GenerateRequest
from rlinfer_sglang import convert

#: the weight-version label rlinfer sets for version ``v`` (SGLang labels are strings)
LABEL_PREFIX = ""


def label(version: int) -> str:
    """SGLang's weight-version label for rlinfer version ``version``."""
    return f"{LABEL_PREFIX}{version}"


def sample_body(
    request: GenerateRequest, ids: Sequence[int], params: dict[str, Any], rid: str, processor: str, stream: bool
) -> dict[str, Any]:
    """The ``/generate`` body of one sample."""
    return {
        "input_ids": list(ids),
        "sampling_params": params,
        "rid": rid,
        "stream": stream,
        "return_hidden_states": request.sampling.return_hidden_states,
        **convert.logprob_args(request, processor),
    }


#: fields a batched body carries once for all its samples (callers batch one priority at a time)
BATCH_SCALARS = ("stream", "priority")
#: per-sample fields only some samples carry, and what a batched body gives the others
BATCH_OPTIONAL: dict[str, Any] = {"image_data": []}


def batch_body(samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One ``/generate`` body for several samples (SGLang's batched form: a list per field), so
    the scheduler sees the whole batch at once, as in-process."""
    if len(samples) == 1:
        return dict(samples[0])
    keys = [k for k in samples[0] if k not in BATCH_SCALARS]
    keys += [k for k in BATCH_OPTIONAL if k not in keys and any(k in s for s in samples)]
    scalars = {k: samples[0][k] for k in BATCH_SCALARS if k in samples[0]}
    fields = {k: [s[k] if k in s else BATCH_OPTIONAL[k] for s in samples] for k in keys}
    return {**fields, **scalars, "stream": False}


def score_body(prompt: Sequence[int], tokens: Sequence[int], start: int, top: int, rid: str) -> dict[str, Any]:
    """A prefill that scores ``prompt + tokens`` (raw logprobs of ``tokens[start:]``), as in-process."""
    return {
        "input_ids": [*prompt, *tokens],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
        "rid": rid,
        "return_logprob": True,
        "logprob_start_len": len(prompt) + start - 1,  # SGLang leaves the first position out
        "top_logprobs_num": top,
    }


def expand_versions(meta: Mapping[str, Any], count: int) -> tuple[int, ...] | None:
    """Per-token versions from SGLang's ``weight_versions`` spans; None when the answer has none
    (an older SGLang) or a span carries a label rlinfer did not set (an attached server)."""
    spans = meta.get("weight_versions")
    if not spans:
        return None
    out: list[int | None] = [None] * count
    for span in spans:
        try:
            version = int(str(span["version"]).removeprefix(LABEL_PREFIX))
        except (TypeError, ValueError, KeyError):
            return None
        for i in range(max(int(span["start"]), 0), min(int(span["end"]), count)):
            out[i] = version
    if any(v is None for v in out):
        return None
    return tuple(v for v in out if v is not None)
