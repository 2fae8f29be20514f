"""hypothesis strategies: valid requests (shaped by the backend's capabilities) and invalid ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from rlinfer_core.types import Capabilities, Capability, ChatMessage, GenerateRequest, SamplingParams


@st.composite
def sampling_params(draw: st.DrawFn, caps: Capabilities, vocab_size: int, max_tokens: int = 16) -> SamplingParams:
    """Valid SamplingParams using only what ``caps`` claims."""
    temperature = draw(st.sampled_from([0.0, 0.0, 0.7, 1.0]))
    top_p = draw(st.sampled_from([1.0, 1.0, 0.9]))
    top_k = draw(st.sampled_from([-1, -1, 8]))
    mx = draw(st.integers(1, max_tokens))
    mn = draw(st.integers(0, mx))
    n = draw(st.integers(1, 3)) if caps.supports(Capability.MULTI_SAMPLE) else 1
    seed = None
    if temperature > 0 and caps.supports(Capability.SEEDED_SAMPLING):
        seed = draw(st.none() | st.integers(0, 2**31 - 1))
    top = draw(st.integers(0, 3)) if caps.supports(Capability.TOP_LOGPROBS) else 0
    stop_ids = draw(st.lists(st.integers(0, vocab_size - 1), max_size=2, unique=True))
    if temperature > 0 and not caps.supports(Capability.LOGPROBS_PROCESSED):
        top_p, top_k = 1.0, -1
    # at most one more processor family per request: the oracle checks each on its own
    families: list[dict[str, object]] = [{}]
    if caps.supports(Capability.SAMPLING_PENALTIES):
        families.append({"repetition_penalty": 1.3, "presence_penalty": 0.5})
        families.append({"frequency_penalty": 0.7})
    if caps.supports(Capability.SAMPLING_LOGIT_BIAS):
        families.append({"logit_bias": {draw(st.integers(0, vocab_size - 1)): 2.0}})
    if caps.supports(Capability.SAMPLING_MIN_P) and top_p == 1.0 and top_k == -1:
        families.append({"min_p": 0.1})
    if caps.supports(Capability.LOGPROBS_RAW):
        families.append({"logprobs_mode": "raw"})
    extra = draw(st.sampled_from(families))
    return SamplingParams(
        **extra,  # type: ignore[arg-type]
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=mx,
        min_tokens=mn,
        n=n,
        seed=seed,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=draw(st.booleans()),
        logprobs=top,
    )


@st.composite
def valid_requests(draw: st.DrawFn, caps: Capabilities, vocab_size: int) -> GenerateRequest:
    """A valid prompt-token request using only what ``caps`` claims."""
    prompt = draw(st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=24))
    return GenerateRequest(prompt_token_ids=prompt, sampling=draw(sampling_params(caps, vocab_size)))


def _bad(**kwargs: Any) -> Callable[[], Any]:
    return lambda: SamplingParams(**kwargs)


def invalid_request_makers(vocab_size: int, max_model_len: int) -> st.SearchStrategy[tuple[str, Callable[[], Any]]]:
    """(label, thunk) pairs; the thunk builds a request batch that must raise InvalidRequest.

    Some fail when the request object is built, others only when the engine validates them
    against the model (ids beyond the vocabulary, prompts longer than the context); none may
    ever reach the engine.
    """
    big = st.integers(vocab_size, vocab_size + 10**6)
    nan = float("nan")

    def req(**kw: Any) -> Callable[[], list[GenerateRequest]]:
        return lambda: [GenerateRequest(**kw)]

    def sp(**kw: Any) -> Callable[[], list[GenerateRequest]]:
        return lambda: [GenerateRequest(prompt_token_ids=[1, 2], sampling=SamplingParams(**kw))]

    return st.one_of(
        big.map(lambda t: ("token beyond vocab", req(prompt_token_ids=[1, t]))),
        st.integers(-(10**6), -1).map(lambda t: ("negative token", req(prompt_token_ids=[t]))),
        st.just(("empty prompt", req(prompt_token_ids=[]))),
        st.just(("no prompt", req())),
        st.just(("prompt and messages", req(prompt_token_ids=[1], messages=[ChatMessage("user", "hi")]))),
        st.just(("empty messages", req(messages=[]))),
        st.text(min_size=1, max_size=8)
        .filter(lambda r: r not in ("system", "user", "assistant", "tool"))
        .map(lambda r: ("bad role", req(messages=[{"role": r, "content": "x"}]))),
        st.integers(max_model_len, max_model_len + 64).map(
            lambda n: ("prompt too long", req(prompt_token_ids=[1] * n))
        ),
        (
            st.floats(max_value=-1e-9, allow_nan=False) | st.floats(min_value=100.0001, allow_nan=False) | st.just(nan)
        ).map(lambda t: ("temperature", sp(temperature=t))),
        (st.floats(max_value=0.0, allow_nan=False) | st.floats(min_value=1.0001, allow_nan=False) | st.just(nan)).map(
            lambda p: ("top_p", sp(top_p=p))
        ),
        st.integers(-(10**6), 0).filter(lambda k: k != -1).map(lambda k: ("top_k", sp(top_k=k))),
        st.integers(-(10**6), 0).map(lambda m: ("max_tokens", sp(max_tokens=m))),
        st.integers(2, 100).map(lambda m: ("min_tokens > max_tokens", sp(max_tokens=1, min_tokens=m))),
        (st.integers(-(10**3), 0) | st.integers(257, 10**4)).map(lambda n: ("n", sp(n=n))),
        st.integers(-(10**6), -1).map(lambda s: ("seed", sp(seed=s))),
        (st.integers(-100, -1) | st.integers(21, 1000)).map(lambda k: ("logprobs", sp(logprobs=k))),
        st.just(("empty stop string", sp(stop=("",)))),
        big.map(lambda t: ("stop id beyond vocab", sp(stop_token_ids=(t,)))),
        st.sampled_from([True, 1.5, "8", None]).map(lambda x: ("max_tokens type", sp(max_tokens=x))),
        st.just(
            (
                "duplicate request ids",
                lambda: [GenerateRequest(prompt_token_ids=[1], request_id="dup")] * 2,
            )
        ),
        st.sampled_from([None, 3, "text", {"prompt_token_ids": [1]}]).map(lambda x: ("not a request", lambda: [x])),
    )
