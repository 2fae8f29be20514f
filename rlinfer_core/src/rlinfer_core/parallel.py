"""Engine parallelism a config asks for, and the refusal where a backend cannot run it.

The sizes live in :class:`~rlinfer_core.types.EngineConfig` (``tensor_parallel_size``,
``data_parallel_size``, ``expert_parallel_size``, ``pipeline_parallel_size``; one meaning each,
see its docstring). Tensor parallelism is part of every backend; the other three are engine
features a backend may lack on a platform. They are not per-request capabilities (no
:class:`~rlinfer_core.types.Capability`): a backend lists each under its name here in its
``Capabilities.notes`` (how it is mapped, or why it is not supported) and refuses a config that
asks for an unsupported one with :class:`~rlinfer_core.errors.UnsupportedCapability` before any
process starts (:func:`refuse_unsupported`).
"""

from __future__ import annotations

from collections.abc import Mapping

from rlinfer_core.errors import UnsupportedCapability
from rlinfer_core.types import EngineConfig

#: experts split whole across ranks (expert_parallel_size > 1)
EXPERT = "parallel.expert"
#: copies of the tensor-parallel group inside one engine (data_parallel_size > 1)
DATA = "parallel.data"
#: layers split across stages (pipeline_parallel_size > 1)
PIPELINE = "parallel.pipeline"

FEATURES = (EXPERT, DATA, PIPELINE)


def requested(config: EngineConfig) -> list[str]:
    """The parallel features ``config`` asks for, in :data:`FEATURES` order."""
    sizes = {
        EXPERT: config.expert_parallel_size,
        DATA: config.data_parallel_size,
        PIPELINE: config.pipeline_parallel_size,
    }
    return [feature for feature in FEATURES if sizes[feature] > 1]


def refuse_unsupported(config: EngineConfig, backend: str, unsupported: Mapping[str, str]) -> None:
    """Raise UnsupportedCapability for the first feature ``config`` asks for that the backend
    cannot run here (``unsupported``: feature -> why)."""
    for feature in requested(config):
        if feature in unsupported:
            raise UnsupportedCapability(feature, backend, unsupported[feature])
