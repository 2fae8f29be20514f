"""SGLang's routed-experts capture on CPU (capability ``generate.routed_experts``).

SGLang keeps the routes in a host buffer allocated with ``pin_memory=True``
(``sglang/srt/state_capturer/base.py``, ``BaseHostCache``), which registers it with
``cudaHostRegister``: on CPU torch that raises and the scheduler dies at start. Pinning only
speeds up device-to-host copies, which a CPU engine does not make, so on CPU the buffer is
allocated as a plain tensor.

The fix must run in SGLang's scheduler processes, which SGLang starts with ``spawn`` (nothing
imported in this process carries over). It travels inside their start arguments: the weight
loader's name in ``ServerArgs.custom_weight_loader`` is a :class:`LoaderName`, a ``str`` whose
unpickling in the scheduler applies :func:`allocate_unpinned_on_cpu` and gives back the plain
name. Only :func:`rlinfer_sglang.config.server_args` uses it, on CPU, with routes enabled.
"""

from __future__ import annotations

from typing import Any


def allocate_unpinned_on_cpu() -> None:
    """Make SGLang allocate its CPU host buffers unpinned (idempotent; CPU torch only)."""
    import torch

    if torch.cuda.is_available():
        return
    from sglang.srt.mem_cache.pool_host import common

    def plain(dims: tuple[int, ...], dtype: torch.dtype, device: str, *_args: Any, **_kwargs: Any) -> torch.Tensor:
        return torch.empty(dims, dtype=dtype, device="cpu")

    common.ALLOC_MEMORY_FUNCS["cpu"] = plain


def _restore(name: str) -> str:
    allocate_unpinned_on_cpu()
    return name


class LoaderName(str):
    """A weight loader's name that applies :func:`allocate_unpinned_on_cpu` where it is unpickled."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_restore, (str(self),))
