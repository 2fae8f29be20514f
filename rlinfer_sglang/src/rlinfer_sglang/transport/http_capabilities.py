"""Capabilities of the SGLang backend in server mode: the in-process set, refined by what the
server reports (``/server_info``) and by where it runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs

from rlinfer_core.types import Capabilities, Capability
from rlinfer_sglang.capabilities import OVERLAP_NOTE, PAUSE_KEEP_OLD_SGLANG_NOTE, PRIORITY_OFF_NOTE

LOOPBACK = ("127.0.0.1", "localhost", "::1")

#: weights.quantized_reload: rlinfer_sglang.scheduler.requantize runs in a server's scheduler too, but has
#: not been run on a GPU in server mode (refused before the server starts)
SERVER_QUANTIZED_RELOAD_NOTE = "not in server mode (not run on a GPU there); use the in-process backend"

SERVER_NOTES = {
    Capability.WEIGHTS_TENSORS.value: (
        "server mode: named tensors travel as shared-memory / CUDA-IPC handles, base64 in the body of "
        "SGLang's /update_weights_from_tensor, to rlinfer's scheduler-side loader (same host only)"
    ),
    Capability.BENCH.value: "server mode: the raw baseline is the same batch through the server's own /generate",
}

SERVER_ROUTES_NOTE = (
    "server mode: not implemented yet (SGLang's /generate returns meta_info.routed_experts, base64 int32, "
    "from a server started with --enable-return-routed-experts; on CPU that server dies at start, its "
    "routing buffer being pinned with cudaHostRegister); use the in-process backend"
)

WEIGHT_CAPS = (
    Capability.WEIGHTS_TENSORS,
    Capability.WEIGHTS_BUCKETS,
    Capability.WEIGHTS_DISK,
    Capability.WEIGHTS_BROADCAST,
    Capability.WEIGHTS_CHECKSUM,
)


def server_capabilities(
    base: Capabilities,
    info: Mapping[str, Any],
    url: str,
    chat_template: bool,
    amx_repacks: bool,
    *,
    begin_end: bool = True,
) -> Capabilities:
    """``base`` (the platform's in-process capabilities) for the server at ``url`` whose
    ``/server_info`` is ``info``; ``begin_end``: the server has ``/begin_weight_update`` (an SGLang
    without it, e.g. 0.5.16, flushes its cache only when no request is pending)."""
    drop: dict[Capability, str] = {
        Capability.LORA: "not in server mode: the SGLang server backend does not implement the LoRA hooks yet; "
        "use the in-process backend",
    }
    drop[Capability.WEIGHTS_QUANTIZED_RELOAD] = SERVER_QUANTIZED_RELOAD_NOTE
    if not begin_end:
        drop[Capability.PAUSE_KEEP] = f"server mode: {PAUSE_KEEP_OLD_SGLANG_NOTE}"
    if not chat_template:
        drop[Capability.CHAT] = "the model's tokenizer has no chat template (or none could be loaded here)"
    if base.platform == "cpu" and amx_repacks:
        drop[Capability.WEIGHTS_CHECKSUM] = (
            "sgl-kernel's CPU ops are installed: SGLang repacks linear weights for AMX after loading"
        )
    if not info.get("enable_priority_scheduling", False):
        drop[Capability.PRIORITY] = PRIORITY_OFF_NOTE
    if not info.get("disable_overlap_schedule", False):
        drop[Capability.SAMPLING_PENALTIES] = OVERLAP_NOTE
    host = urlsplit(url).hostname or ""
    if host not in LOOPBACK:
        why = (
            f"the server at {url} is on another host: rlinfer's scheduler-side loader reports its outcome "
            "through a file on this host and tensors travel as shared-memory / CUDA-IPC handles, which do "
            "not cross hosts"
        )
        for capability in WEIGHT_CAPS:
            drop[capability] = why
    if not info.get("enable_return_hidden_states", False):
        drop[Capability.GENERATE_HIDDEN_STATES] = "the server was started without --enable-return-hidden-states"
    if not info.get("enable_deterministic_inference", False):
        drop[Capability.DETERMINISTIC] = "the server was started without --enable-deterministic-inference"
    if base.platform == "cuda" and not info.get("enable_memory_saver", False):
        drop[Capability.MEMORY_RELEASE] = "the server was started without SGLang's memory saver (--enable-memory-saver)"
    return attrs.evolve(base, notes={**base.notes, **SERVER_NOTES}).without(drop)
