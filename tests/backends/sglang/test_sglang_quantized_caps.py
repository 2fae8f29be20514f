"""weights.quantized_reload on SGLang (no engine): not on CPU (SGLang's FP8 linear method needs
AMX, measured), claimed on CUDA in process (rlinfer_sglang.scheduler.requantize), not in server mode."""

from __future__ import annotations

from rlinfer_core.types import Capability, EngineConfig
from rlinfer_sglang.capabilities import capabilities
from rlinfer_sglang.transport.http_capabilities import server_capabilities

QUANTIZED = Capability.WEIGHTS_QUANTIZED_RELOAD


def test_fp8_reload_not_on_cpu_with_the_measured_reason() -> None:
    cpu = capabilities("cpu", "sglang 0.5.23")
    assert not cpu.supports(QUANTIZED)
    assert "requires that CPU has AMX support" in cpu.notes[QUANTIZED.value]


def test_fp8_reload_claimed_on_cuda_in_process_only() -> None:
    cuda = capabilities("cuda", "sglang 0.5.16")
    assert cuda.supports(QUANTIZED) and "requantize" in cuda.notes[QUANTIZED.value]
    server = server_capabilities(cuda, {}, "http://127.0.0.1:30000", True, False)
    assert not server.supports(QUANTIZED) and "server mode" in server.notes[QUANTIZED.value]


def test_fp8_engine_refused_before_a_server_starts() -> None:
    from rlinfer_sglang.plugin import create

    backend = create(EngineConfig(model="m", mode="server", engine_kwargs={"quantization": "fp8"}))
    assert not backend.rlinfer_capabilities().supports(QUANTIZED)
