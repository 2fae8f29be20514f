"""SGLang's KV-cache limits and out-of-memory signals, as rlinfer's (in-process and server mode).

SGLang may start with a KV pool smaller than one context-length request (it warns, "KV pool holds
N tokens, fewer than --context-length"): it then refuses a prompt of ``max_req_input_len`` tokens
or more (an abort with HTTP 400, "Input length (...) exceeds the maximum allowed length") and
silently clips ``max_new_tokens`` to the room left in the pool. rlinfer reports that room as
``ModelInfo.kv_capacity_tokens``, so the facade refuses such requests before they are sent; the
engine's own refusals are mapped here as a second line. KV pressure from other requests is no
error: SGLang retracts decoding requests and queues them again.
"""

from __future__ import annotations

from rlinfer_core.errors import EngineOutOfMemory
from rlinfer_core.model_info import ModelInfo

#: SGLang's refusal of a prompt longer than its max_req_input_len (managers/utils.py)
INPUT_TOO_LONG = "exceeds the maximum allowed length"
#: a request that does not fit even after every other one was retracted (schedule_batch.py)
NEVER_FITS = "Out of memory even after retracting all other requests"
#: a request retracted under decode pressure without a KV backup: SGLang says "Retry later"
RETRY_LATER = "Retracted under decode memory pressure"


def kv_capacity_tokens(max_req_input_len: object, max_model_len: int) -> int | None:
    """``ModelInfo.kv_capacity_tokens`` from SGLang's ``max_req_input_len`` (``min(context - 1,
    pool - 1) - 5``): the KV pool binds when it is below what max_model_len allows (rlinfer starts
    SGLang with a context of max_model_len + 5). A request of at most that many tokens, prompt and
    output, is neither refused nor clipped; None where the context binds."""
    if isinstance(max_req_input_len, int) and 0 < max_req_input_len < max_model_len - 1:
        return max_req_input_len
    return None


def out_of_memory(message: str, info: ModelInfo | None) -> EngineOutOfMemory | None:
    """The EngineOutOfMemory of an SGLang refusal or abort ``message``; None for other errors."""
    capacity = info.kv_capacity_tokens if info is not None else None
    if RETRY_LATER in message:
        return EngineOutOfMemory(f"SGLang turned the request away under KV pressure: {message}", transient=True)
    if NEVER_FITS in message:
        return EngineOutOfMemory(
            f"the request does not fit SGLang's KV cache: {message}", transient=False, capacity_tokens=capacity
        )
    if INPUT_TOO_LONG in message and capacity is not None:  # else the context, not the KV cache, binds
        return EngineOutOfMemory(
            f"the prompt does not fit SGLang's KV cache ({capacity} tokens for one request): {message}",
            transient=False,
            capacity_tokens=capacity,
        )
    return None
