"""Named tensors shared by reference (SGLang's /update_weights_from_tensor payloads): what is
read, and what is refused."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.transfer.shared_tensors import load_named_tensors


@pytest.fixture(autouse=True)
def _restore_sharing_strategy() -> Iterator[None]:
    strategy = torch.multiprocessing.get_sharing_strategy()
    yield
    torch.multiprocessing.set_sharing_strategy(strategy)


def _payload(obj: object) -> bytes:
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(obj)
    return buffer.getvalue()


def test_tensors_in_shared_memory_are_read_and_copied() -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")
    tensors = [("a.weight", torch.randn(3, 4)), ("b", torch.arange(6, dtype=torch.bfloat16)[1:4])]
    loaded = load_named_tensors(_payload(tensors))
    assert [name for name, _ in loaded] == ["a.weight", "b"]
    for (_, sent), (_, got) in zip(tensors, loaded, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    tensors[0][1].zero_()  # the trainer reuses its memory: the loaded copy keeps the values
    assert loaded[0][1].abs().sum() > 0


def test_descriptor_sharing_is_refused_with_the_advice() -> None:
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    with pytest.raises(InvalidRequest, match="file_system"):
        load_named_tensors(_payload([("a", torch.ones(2))]))


def test_other_objects_are_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"refused object in the payload: posix\.system"):
        load_named_tensors(pickle.dumps(os.system))
    with pytest.raises(InvalidRequest, match="list of \\(name, tensor\\) pairs"):
        load_named_tensors(pickle.dumps([("a", 1)]))
    with pytest.raises(InvalidRequest, match="cannot read the payload"):
        load_named_tensors(b"not a pickle")
