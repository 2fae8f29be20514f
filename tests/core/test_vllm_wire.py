"""vLLM's weight-transfer wire without an engine: the packed buffer cut, and the rendezvous's
pickled unique id (with a stand-in for vLLM's ctypes class, named as vLLM names it)."""

from __future__ import annotations

import ctypes
import pickle
import sys
import types
from collections.abc import Iterator

import pytest

from rlinfer_core.errors import WeightUpdateError
from rlinfer_core.transfer.vllm_wire import packed_chunks, unique_id_from_store
from rlinfer_core.weights import TensorSpec

VLLM_WRAPPER = "vllm.distributed.device_communicators.pynccl_wrapper"


def _spec(name: str, numel: int, dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, dtype, (numel,))


def test_a_buffer_closes_once_it_exceeds_the_size() -> None:
    specs = [_spec("a", 10), _spec("b", 10), _spec("c", 10), _spec("d", 2)]  # 40, 40, 40, 8 bytes
    assert [[s.name for s in chunk] for chunk in packed_chunks(specs, 64)] == [["a", "b"], ["c", "d"]]
    assert [[s.name for s in chunk] for chunk in packed_chunks(specs, 80)] == [["a", "b", "c"], ["d"]]


def test_a_tensor_larger_than_the_buffer_travels_alone_and_sizes_use_the_dtype() -> None:
    specs = [_spec("big", 100, "bfloat16"), _spec("small", 4, "bfloat16"), _spec("tail", 1, "int64")]
    assert [[s.name for s in chunk] for chunk in packed_chunks(specs, 16)] == [["big"], ["small", "tail"]]
    assert packed_chunks([], 16) == []


@pytest.fixture
def vllm_unique_id_class() -> Iterator[type[ctypes.Structure]]:
    """A stand-in for vLLM's ``ncclUniqueId`` under vLLM's module name, removed again before the
    test unpickles, so the reader cannot lean on it."""

    class ncclUniqueId(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 128)]

    parts = VLLM_WRAPPER.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    saved = {name: sys.modules.get(name) for name in names}
    for name in names:
        sys.modules[name] = types.ModuleType(name)
    ncclUniqueId.__module__ = VLLM_WRAPPER
    ncclUniqueId.__qualname__ = "ncclUniqueId"
    sys.modules[VLLM_WRAPPER].ncclUniqueId = ncclUniqueId  # type: ignore[attr-defined]
    yield ncclUniqueId
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module


def test_the_unique_id_is_read_without_vllm(vllm_unique_id_class: type[ctypes.Structure]) -> None:
    uid = vllm_unique_id_class()
    for i in range(128):
        uid.internal[i] = (i * 37) % 256 - 128  # type: ignore[attr-defined]
    payload = pickle.dumps(uid)
    del sys.modules[VLLM_WRAPPER].ncclUniqueId  # type: ignore[attr-defined]
    assert unique_id_from_store(payload) == bytes(uid.internal)  # type: ignore[attr-defined]


def test_anything_else_in_the_rendezvous_is_refused() -> None:
    with pytest.raises(pickle.UnpicklingError, match="unexpected object"):
        unique_id_from_store(pickle.dumps(types.SimpleNamespace(a=1)))
    with pytest.raises(WeightUpdateError, match="not an ncclUniqueId"):
        unique_id_from_store(pickle.dumps(b"x" * 128))
