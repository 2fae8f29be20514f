"""Capabilities of the vLLM backend in server mode: the in-process set, refined by what the server
reports and by where it runs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import attrs

from rlinfer_core.types import Capabilities, Capability
from rlinfer_vllm.capabilities import PRIORITY_OFF_NOTE

LOOPBACK = ("127.0.0.1", "localhost", "::1")

#: why rlinfer's text output is missing in server mode (not a capability; documented here)
TEXT_NOTE = "server mode returns token ids only (Completion.text is None): vLLM's token endpoint gives ids"

SERVER_NOTES = {
    Capability.WEIGHTS_TENSORS.value: (
        "server mode: named tensors travel as shared-memory / CUDA-IPC handles through the server's "
        "/collective_rpc into rlinfer's worker extension (same host only)"
    ),
    Capability.BENCH.value: "server mode: the raw baseline is the server's own /v1/completions with token-id prompts",
}


def server_capabilities(base: Capabilities, facts: Mapping[str, Any], url: str, launched: bool) -> Capabilities:
    """``base`` (the platform's in-process capabilities) for a server described by ``facts``
    (``RLInferWorkerExtension.rlinfer_server_facts``) at ``url``."""
    drop: dict[Capability, str] = {}
    if facts["quantized"] or facts["tensor_parallel_size"] != 1:
        drop[Capability.WEIGHTS_CHECKSUM] = "needs an unquantized model and tensor_parallel_size=1"
    if facts.get("scheduling_policy") != "priority":
        drop[Capability.PRIORITY] = PRIORITY_OFF_NOTE
    if not facts["chat_template"]:
        drop[Capability.CHAT] = "the model's tokenizer has no chat template"
    host = urlsplit(url).hostname or ""
    if host not in LOOPBACK:
        why = (
            f"the server at {url} is on another host: shared-memory / CUDA-IPC handles do not cross "
            "hosts; send a checkpoint directory (weights.disk) or use a broadcast group"
        )
        drop[Capability.WEIGHTS_TENSORS] = why
        drop[Capability.WEIGHTS_BUCKETS] = why
    if not launched:
        # memory release depends on how someone else started the server; not claimed blind
        drop.setdefault(
            Capability.MEMORY_RELEASE,
            base.notes.get(Capability.MEMORY_RELEASE.value, "")
            or "attached server: its sleep mode is not known to rlinfer",
        )
        drop[Capability.MEMORY_DISCARD_WEIGHTS] = drop[Capability.MEMORY_RELEASE]
    notes = {**base.notes, **SERVER_NOTES, **{c.value: why for c, why in drop.items()}}
    return attrs.evolve(base, supported=base.supported - set(drop), notes=notes)
