"""rlinfer's errors pickle whole, so they cross Ray actor calls (the verl plugin's server actor,
pools) as their own type, message and attributes."""

from __future__ import annotations

import pickle

from rlinfer_core import errors


def test_every_error_pickles_with_its_type_message_and_attributes() -> None:
    samples = [
        errors.InvalidRequest("max_tokens", "must be >= 1, got 0"),
        errors.UnsupportedCapability("memory.release", "vllm", "CPU engines cannot free memory"),
        errors.WeightVerificationError("differs", ["a"], ["b"]),
        errors.EngineDead("gone"),
    ]
    for exc in samples:
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc)
        assert back.__dict__ == exc.__dict__
    unsupported = pickle.loads(pickle.dumps(samples[1]))
    assert (unsupported.capability, unsupported.backend) == ("memory.release", "vllm")
