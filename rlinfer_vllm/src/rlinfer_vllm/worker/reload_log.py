"""Silence one false warning of vLLM's layer-wise weight reload, at its source logger.

vLLM 0.32's layer-wise reload (``vllm/model_executor/model_loader/reload/layerwise.py``, used by
``Worker.reload_weights``: rlinfer's reload mode and the raw bench reload) counts every tensor of
a module as loadable, non-persistent buffers included. ``RotaryEmbedding`` holds only its
``cos_sin_cache``: computed at start from the config, in no checkpoint. So every reload logs
``RotaryEmbedding: Failed to load weights`` and then puts the cache back as it was
(``_place_kernel_tensors``), which is exactly right: the warning is harmless.

:func:`quiet_buffer_only_layers` drops that record only for module classes whose every instance
in the served model holds non-persistent buffers and nothing else; a layer with parameters or
persistent buffers that loads nothing still warns.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: the logger of vLLM's layer-wise reload, and its message for a layer that loaded nothing
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
FAILED_TO_LOAD = "%s: Failed to load weights"


class BufferOnlyLayersFilter(logging.Filter):
    """Drops ``<class>: Failed to load weights`` for the given module class names."""

    def __init__(self, class_names: frozenset[str]) -> None:
        super().__init__()
        self.class_names = class_names

    def filter(self, record: logging.LogRecord) -> bool:
        """False (drop) for the false warning of a buffer-only layer; True for everything else."""
        args = record.args
        return not (
            record.msg == FAILED_TO_LOAD and isinstance(args, tuple) and len(args) == 1 and args[0] in self.class_names
        )


def buffer_only_classes(model: torch.nn.Module) -> frozenset[str]:
    """Names of the module classes whose every instance in ``model`` has no parameters and only
    non-persistent buffers (nothing a checkpoint could hold)."""
    verdict: dict[str, bool] = {}
    for module in model.modules():
        buffers = {name for name, b in module._buffers.items() if b is not None}
        only = (
            bool(buffers)
            and not any(p is not None for p in module._parameters.values())
            and buffers <= set(module._non_persistent_buffers_set)
        )
        name = type(module).__name__
        verdict[name] = verdict.get(name, True) and only
    return frozenset(name for name, ok in verdict.items() if ok)


def quiet_buffer_only_layers(model: torch.nn.Module) -> frozenset[str]:
    """Install (once per process) the filter on vLLM's reload logger; return the classes it covers."""
    names = buffer_only_classes(model)
    logger = logging.getLogger(RELOAD_LOGGER)
    for old in [f for f in logger.filters if isinstance(f, BufferOnlyLayersFilter)]:
        logger.removeFilter(old)
    if names:
        logger.addFilter(BufferOnlyLayersFilter(names))
    return names
