"""TEST-ONLY double: a RecordingDoubleBackend whose KV cache is small and whose first generate
calls are turned away with a transient EngineOutOfMemory (core unit tests of the retry)."""

from __future__ import annotations

from collections.abc import Sequence

from recording_double import MAX_LEN, VOCAB, RecordingDoubleBackend, describe

from rlinfer_core import hookimpl
from rlinfer_core.discovery import BackendInfo
from rlinfer_core.errors import EngineOutOfMemory
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.types import Completion, EngineConfig, GenerateRequest

#: the double's KV room for one request (below its max_model_len, MAX_LEN)
KV_CAPACITY = MAX_LEN - 8


class OutOfMemoryDoubleBackend(RecordingDoubleBackend):
    """Turns away the first ``engine_kwargs["transient_failures"]`` generate calls."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.failures_left = int(config.engine_kwargs.get("transient_failures", 0))

    @hookimpl
    def rlinfer_model_info(self) -> ModelInfo:
        return ModelInfo(VOCAB, MAX_LEN, (0,), kv_capacity_tokens=KV_CAPACITY)

    @hookimpl
    async def rlinfer_generate(self, requests: Sequence[GenerateRequest]) -> list[Completion]:
        if self.failures_left > 0:
            self.failures_left -= 1
            self.calls.append(("generate_turned_away", [r.request_id for r in requests]))
            raise EngineOutOfMemory("the double's KV cache is busy", transient=True)
        return await super().rlinfer_generate(requests)


def make_out_of_memory_double(config: EngineConfig) -> OutOfMemoryDoubleBackend:
    """Factory named by :data:`OOM_DOUBLE_INFO`."""
    return OutOfMemoryDoubleBackend(config)


OOM_DOUBLE_INFO = BackendInfo(
    "oom-double", ("pluggy>=1",), "out_of_memory_double:make_out_of_memory_double", describe, summary="test double"
)
