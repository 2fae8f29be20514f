"""ipc.loads attaches again, and ipc.dumps shares again, when torch's shared-memory manager times
out (a transient of a loaded host), and only then. The failing attach is a test double: an object
whose unpickling raises torch's error a given number of times; the failing share is
``Tensor.share_memory_`` replaced by one that raises it first."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from rlinfer_core.transfer import ipc

_failures_left: list[int] = [0]


def _rebuild(value: Any, message: str) -> Any:
    if _failures_left[0] > 0:
        _failures_left[0] -= 1
        raise RuntimeError(message)
    return value


class FlakyAttachDouble:
    """Unpickles to ``value`` once ``_failures_left`` attaches have failed with ``message``."""

    def __init__(self, value: Any, message: str = ipc.MANAGER_TIMEOUT) -> None:
        self.value, self.message = value, message

    def __reduce__(self) -> tuple[Any, tuple[Any, str]]:
        return _rebuild, (self.value, self.message)


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The backoff sleeps ``ipc`` takes, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(ipc.time, "sleep", slept.append)
    return slept


def test_a_manager_timeout_is_attached_again_after_growing_waits(waits: list[float]) -> None:
    _failures_left[0] = ipc.MANAGER_TRIES - 1
    payload = pickle.dumps([("w", FlakyAttachDouble(3))])
    assert ipc.loads(payload) == [("w", 3)]
    assert _failures_left[0] == 0
    assert waits == list(ipc.MANAGER_BACKOFF_S)
    assert waits == sorted(waits) and sum(waits) >= 5.0  # outlasts a few missed 1 s polls


def test_a_manager_that_never_answers_fails_after_the_tries(waits: list[float]) -> None:
    _failures_left[0] = ipc.MANAGER_TRIES
    with pytest.raises(RuntimeError, match=ipc.MANAGER_TIMEOUT):
        ipc.loads(pickle.dumps([("w", FlakyAttachDouble(3))]))
    assert waits == list(ipc.MANAGER_BACKOFF_S)  # no wait after the last try


def test_another_error_is_not_tried_again(waits: list[float]) -> None:
    _failures_left[0] = 1
    with pytest.raises(RuntimeError, match="unable to mmap"):
        ipc.loads(pickle.dumps([("w", FlakyAttachDouble(3, "unable to mmap"))]))
    assert _failures_left[0] == 0
    assert waits == []


def test_a_manager_timeout_while_sharing_is_shared_again(waits: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    share = torch.Tensor.share_memory_
    failures = [2]

    def flaky_share(tensor: Any) -> Any:
        if failures[0] > 0:
            failures[0] -= 1
            raise RuntimeError(ipc.MANAGER_TIMEOUT)
        return share(tensor)

    monkeypatch.setattr(torch.Tensor, "share_memory_", flaky_share)
    weights = torch.arange(6, dtype=torch.float32)
    ((name, got),) = ipc.loads(ipc.dumps([("w", weights)]))
    assert name == "w" and torch.equal(got, weights) and got.is_shared()
    assert failures == [0] and waits == list(ipc.MANAGER_BACKOFF_S[:2])
