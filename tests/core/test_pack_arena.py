"""PackArena: an update of the same layout is packed into the same buffers with its new bytes; a
new layout gets new buffers; clearing, a failed send and the opt-out drop them; the receiver's
keep_mapped keeps CUDA tensors only."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensor_helpers import make_tensor

from rlinfer_core.transfer import ipc
from rlinfer_core.transfer.arena import REUSE_ENV, PackArena, engine_arena
from rlinfer_core.transfer.buckets import pack, unpack_all, verify

DTYPES = ["float32", "bfloat16", "int64", "uint8", "bool"]
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


def weights(seed: int, specs: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
    return [(f"layer.{i}.w", make_tensor(d, s, seed + i)) for i, (d, s) in enumerate(specs)]


def ptrs(buckets: list) -> list[int]:
    return [b.data.data_ptr() for b in buckets]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(DTYPES), shapes), min_size=1, max_size=10), st.integers(1, 300))
def test_same_layout_reuses_the_buffers_with_the_new_bytes(specs: list, limit: int) -> None:
    arena = PackArena()
    first_tensors, second_tensors = weights(0, specs), weights(1000, specs)
    first = arena.pack(first_tensors, limit)
    held = ptrs(first)
    second = arena.pack(second_tensors, limit)
    assert ptrs(second) == held  # the same storages: the receiver maps nothing new
    assert arena.reuses == 1
    fresh = pack(second_tensors, limit)
    assert [b.manifest for b in second] == [b.manifest for b in fresh]  # checksums of the new bytes too
    for bucket in second:
        verify(bucket)
    got = dict(unpack_all(second))
    for name, t in second_tensors:
        assert torch.equal(got[name], t), name


def test_a_new_layout_gets_new_buffers_and_drops_the_old() -> None:
    arena = PackArena()
    a = weights(0, [("float32", (4, 3)), ("bfloat16", (5,))])
    first = arena.pack(a, 1 << 20)
    nbytes = arena.nbytes
    assert nbytes == sum(b.manifest.nbytes for b in first)
    changed_shape = weights(1, [("float32", (3, 4)), ("bfloat16", (5,))])
    renamed = [(f"other.{n}", t) for n, t in a]
    fewer = a[:1]
    for other in (changed_shape, renamed, fewer):
        before = arena.pack(a, 1 << 20)
        again = arena.pack(other, 1 << 20)
        assert not set(ptrs(again)) & set(ptrs(before))
        assert dict(unpack_all(again)).keys() == {n for n, _ in other}
    before = arena.pack(a, 1 << 20)
    other_limit = arena.pack(a, 1 << 10)  # the bucket size is part of the layout
    assert not set(ptrs(other_limit)) & set(ptrs(before))
    assert arena.reuses == 1  # the loop's first pack of ``a`` right after the first one


def test_repeated_names_are_packed_but_never_reused() -> None:
    arena = PackArena()
    twice = [("w", torch.ones(3)), ("w", torch.zeros(3))]
    first, second = arena.pack(twice), arena.pack(twice)
    assert [e.name for e in first[0].manifest.entries] == ["w", "w"]
    assert not set(ptrs(first)) & set(ptrs(second))
    assert arena.reuses == 0 and arena.nbytes == 0


def test_clear_and_a_failed_send_drop_the_buffers() -> None:
    arena = PackArena()
    tensors = weights(0, [("float32", (8,))])
    first = arena.pack(tensors)
    arena.clear()
    assert arena.nbytes == 0
    assert ptrs(arena.pack(tensors)) != ptrs(first)
    assert arena.reuses == 0
    with arena.sending():  # a send that returns keeps them
        pass
    assert arena.nbytes > 0
    with pytest.raises(RuntimeError), arena.sending():
        raise RuntimeError("the receiver may still read the buffers")
    assert arena.nbytes == 0
    arena.pack(tensors)
    assert arena.reuses == 0


def test_close_asks_the_receiver_to_let_go_only_after_a_pack() -> None:
    import asyncio

    calls: list[str] = []

    async def lets_go() -> None:  # a test double of the engine's call
        calls.append("let go")

    async def dead_engine() -> None:
        raise RuntimeError("the engine is gone")

    untouched = PackArena()
    asyncio.run(untouched.close(lets_go))
    assert calls == []  # nothing packed (a CPU engine): no call at shutdown
    arena = PackArena()
    arena.pack(weights(0, [("float32", (8,))]))
    asyncio.run(arena.close(lets_go))
    assert calls == ["let go"] and arena.nbytes == 0
    arena.pack(weights(0, [("float32", (8,))]))
    asyncio.run(arena.close(dead_engine))  # best effort: shutdown goes on
    assert arena.nbytes == 0
    off = PackArena(keep=False)  # the opt-out: the engine was told to keep nothing
    off.pack(weights(0, [("float32", (8,))]))
    asyncio.run(off.close(lets_go))
    assert calls == ["let go"]


def test_reuse_is_off_unless_the_environment_turns_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = weights(0, [("float32", (8,))])
    monkeypatch.delenv(REUSE_ENV, raising=False)
    for setting in (None, "0"):
        if setting is not None:
            monkeypatch.setenv(REUSE_ENV, setting)
        off = engine_arena()
        first = off.pack(tensors)
        assert off.nbytes == 0
        assert not set(ptrs(off.pack(tensors))) & set(ptrs(first))
        assert off.reuses == 0
    monkeypatch.setenv(REUSE_ENV, "1")
    on = engine_arena()
    assert ptrs(on.pack(tensors)) == ptrs(on.pack(tensors))


def test_pack_cuda_leaves_host_tensors_to_shared_memory() -> None:
    arena = PackArena()
    assert ipc.pack_cuda(weights(0, [("float32", (2,))]), arena=arena) is None
    assert arena.nbytes == 0


def test_keep_mapped_keeps_no_host_tensors() -> None:
    assert ipc.keep_mapped([torch.ones(2)]) == 0
    assert ipc._MAPPED == []
    assert ipc.keep_mapped(()) == 0
