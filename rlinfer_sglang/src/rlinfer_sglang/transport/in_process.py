"""The in-process transport: SGLang's offline ``Engine``, driven through its tokenizer manager.

SGLang's Engine keeps its tokenizer manager in the caller's process and event loop and runs the
scheduler (model + KV cache) and the detokenizer in child processes. This transport drives the
tokenizer manager's async API directly (the Engine's sync wrappers would block the loop), every
call raced against the engine's death. Process care (start, signals, death, shutdown) is the
:class:`~rlinfer_sglang.transport.supervision.Supervision` component the transport owns.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from typing_extensions import override

from rlinfer_core.errors import EngineDead, RLInferError
from rlinfer_core.types import Capabilities, Capability, EngineConfig
from rlinfer_sglang.capabilities import (
    AMX_NOTE,
    HIDDEN_STATES_OFF_NOTE,
    OVERLAP_NOTE,
    PAUSE_KEEP_OLD_SGLANG_NOTE,
    PRIORITY_OFF_NOTE,
    ROUTES_OFF_NOTE,
    Platform,
    amx_repacks,
)
from rlinfer_sglang.config import WEIGHT_LOADER
from rlinfer_sglang.requests import priority_sign
from rlinfer_sglang.transport import Served, Transport
from rlinfer_sglang.transport.supervision import Supervision

T = TypeVar("T")


def _io() -> Any:
    from sglang.srt.managers import io_struct

    return io_struct


class InProcessTransport(Transport):
    """SGLang's offline Engine in this process (``EngineConfig(mode="in_process")``, the default)."""

    abort_settle_s = 0.0  # the tokenizer manager registers a request before it is sent
    off_before_start: Mapping[Capability, str] = {}

    def __init__(self, config: EngineConfig, platform: Platform) -> None:
        self.config = config
        self.platform = platform
        self._supervision = Supervision(platform)
        self.tp_size = config.world_size
        self.begin_end = True
        self.flush_needs_idle = False
        self.salts = True
        self.update_pause = "in_place"

    @override
    async def start(self, capabilities: Capabilities) -> Served:
        await self._supervision.launch(self.config)
        tm = self._tm
        args = getattr(tm, "server_args", None)
        self.begin_end = hasattr(_io(), "BeginWeightUpdateReqInput")
        self.flush_needs_idle = not self.begin_end
        # both SGLang 0.5.16 and 0.5.2x key their radix cache by GenerateReqInput.extra_key
        self.salts = "extra_key" in getattr(_io().GenerateReqInput, "__dataclass_fields__", {})
        self.update_pause = "in_place" if getattr(args, "disable_overlap_schedule", False) else "retract"
        mc = tm.model_config
        tokenizer = getattr(tm, "tokenizer", None)
        eos = {int(t) for t in (getattr(mc, "hf_eos_token_id", None) or ())}
        tied = bool(getattr(getattr(mc, "hf_text_config", None) or mc.hf_config, "tie_word_embeddings", False))
        limit = getattr(tm, "max_req_input_len", None)
        return Served(
            capabilities=capabilities.without(self._off(capabilities, tokenizer, args)),
            context_len=int(mc.context_len),
            max_req_input_len=limit if isinstance(limit, int) else None,
            vocab_size=int(mc.vocab_size),
            eos_token_ids=frozenset(eos),
            tied_embeddings=tied,
            served_dtype=None if self.config.dtype == "auto" else str(mc.dtype).removeprefix("torch."),
            model_dir=self._model_dir(),
            tokenizer=tokenizer,
            priority_sign=priority_sign(args),
            hidden_size=getattr(mc, "hidden_size", None),
        )

    def _off(self, caps: Capabilities, tokenizer: Any, args: Any) -> dict[Capability, str]:
        """What this engine cannot do once started (its configuration and SGLang version decide)."""
        off: dict[Capability, str] = {}
        if getattr(tokenizer, "chat_template", None) is None:
            off[Capability.CHAT] = "the model's tokenizer has no chat template"
        if self.platform == "cpu" and Capability.WEIGHTS_CHECKSUM in caps.supported and amx_repacks():
            off[Capability.WEIGHTS_CHECKSUM] = AMX_NOTE
        if not getattr(args, "disable_overlap_schedule", True):
            off[Capability.SAMPLING_PENALTIES] = OVERLAP_NOTE
        if not self.begin_end:
            off[Capability.PAUSE_KEEP] = PAUSE_KEEP_OLD_SGLANG_NOTE
        if priority_sign(args) is None:
            off[Capability.PRIORITY] = PRIORITY_OFF_NOTE
        if not getattr(args, "enable_return_routed_experts", False):
            off[Capability.GENERATE_ROUTED_EXPERTS] = (
                "the model has no routed experts (or no local config.json)"
                if self.config.enable_routed_experts
                else ROUTES_OFF_NOTE
            )
        if not getattr(args, "enable_return_hidden_states", False):
            off[Capability.GENERATE_HIDDEN_STATES] = HIDDEN_STATES_OFF_NOTE
        return off

    def _model_dir(self) -> str:
        if Path(self.config.model).is_dir():
            return self.config.model
        from huggingface_hub import snapshot_download

        return str(snapshot_download(self.config.model, allow_patterns=["*.safetensors", "*.json"]))

    @property
    def _tm(self) -> Any:
        """SGLang's tokenizer manager, as the supervision holds it."""
        return self._supervision.tokenizer_manager

    # --- process care --------------------------------------------------------------------------

    @override
    def alive(self) -> None:
        self._supervision.alive()

    @override
    async def guard(self, awaitable: Awaitable[T]) -> T:
        return await self._supervision.guard(awaitable)

    @override
    def translate(self, exc: Exception) -> Exception:
        dead = self._supervision.dead
        if dead is not None and not isinstance(exc, RLInferError):
            return EngineDead(f"the SGLang engine died ({dead}): {exc}")
        return exc

    @override
    async def check_health(self) -> None:
        await self._supervision.check_health()

    @override
    async def shutdown(self) -> None:
        await self._supervision.shutdown()

    @override
    def processes(self) -> Mapping[str, int]:
        return self._supervision.processes()

    # --- generation ----------------------------------------------------------------------------

    @override
    async def generate(self, body: Mapping[str, Any]) -> Any:
        obj = _io().GenerateReqInput(**body)
        return await self.guard(self._tm.generate_request(obj, None).__anext__())

    @override
    async def stream(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        generator = self._tm.generate_request(_io().GenerateReqInput(**body), None)
        while True:
            try:
                out = await self.guard(generator.__anext__())
            except StopAsyncIteration:
                return
            yield out

    @override
    async def abort(self, rids: Sequence[str]) -> None:
        self.abort_soon(rids)

    @override
    def abort_soon(self, rids: Sequence[str]) -> None:
        for rid in rids:
            with contextlib.suppress(Exception):
                self._tm.abort_request(rid=rid)

    @override
    async def pause(self, mode: str) -> None:
        await self.guard(self._tm.pause_generation(_io().PauseGenerationReqInput(mode=mode)))

    @override
    async def unpause(self) -> None:
        await self.guard(self._tm.continue_generation(_io().ContinueGenerationReqInput()))

    @override
    async def flush(self, wait_s: float = 0.0) -> bool:
        import inspect

        # waiting for idle inside SGLang needs its timeout_s (an older tokenizer manager flushes at once)
        waits = wait_s > 0 and "timeout_s" in inspect.signature(self._tm.flush_cache).parameters
        flushing = self._tm.flush_cache(timeout_s=wait_s) if waits else self._tm.flush_cache()
        return bool((await self.guard(flushing)).success)

    @override
    async def release_memory(self, tags: list[str]) -> None:
        obj = _io().ReleaseMemoryOccupationReqInput(tags=tags)
        await self.guard(self._tm.release_memory_occupation(obj, None))

    @override
    async def resume_memory(self, tags: list[str]) -> None:
        obj = _io().ResumeMemoryOccupationReqInput(tags=tags)
        await self.guard(self._tm.resume_memory_occupation(obj, None))

    # --- weights -------------------------------------------------------------------------------

    @override
    async def serialize(self, pairs: list[tuple[str, Any]]) -> list[Any]:
        from sglang.srt.utils import MultiprocessingSerializer

        loop = asyncio.get_running_loop()
        # one serialization per TP rank: a CPU tensor travels as a file descriptor that
        # multiprocessing's resource sharer hands out once, so ranks cannot share one payload
        return [
            await loop.run_in_executor(None, MultiprocessingSerializer.serialize, pairs) for _ in range(self.tp_size)
        ]

    @override
    async def begin_update(self) -> tuple[bool, str]:
        ok, message = await self.guard(self._tm.begin_weight_update(_io().BeginWeightUpdateReqInput(), None))
        return bool(ok), str(message)

    @override
    async def update_tensors(
        self, payloads: list[Any], flush: bool, before_send: Callable[[], None] | None
    ) -> tuple[bool, str]:
        req = _io().UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=payloads, load_format=WEIGHT_LOADER, flush_cache=flush
        )

        async def send() -> Any:  # before_send and the send in one task step
            if before_send is not None:
                before_send()
            return await self._tm.update_weights_from_tensor(req, None)

        ok, message = (await self.guard(send()))[:2]
        return bool(ok), str(message)

    @override
    async def end_update(self) -> tuple[bool, str]:
        ok, message = await self.guard(self._tm.end_weight_update(_io().EndWeightUpdateReqInput(), None))
        return bool(ok), str(message)

    @override
    async def label(self, version: int) -> tuple[bool, str]:
        return True, ""  # versions come from the loader's record (no spans read in process)

    @override
    def dispatched(self, rids: Sequence[str], received: Mapping[str, int]) -> set[str]:
        states = getattr(self._tm, "rid_to_state", {})
        return {r for r in rids if r not in states or _sent(states[r])}

    @override
    def unsent(self, rids: Sequence[str]) -> list[str]:
        # a rid without a state: its call has not reached the tokenizer manager yet, or it ended
        # there (the caller's call returns soon); with a state: until it is sent to the scheduler
        states = getattr(self._tm, "rid_to_state", {})
        return [r for r in rids if r not in states or not _sent(states[r])]

    @override
    async def update_from_disk(self, path: str) -> tuple[bool, str]:
        # the format named, not left to the tokenizer manager: it reads the process-wide config,
        # which the last SGLang engine opened in this process set (a dummy start's "dummy")
        request = _io().UpdateWeightFromDiskReqInput(model_path=path, load_format="auto")
        if hasattr(request, "flush_cache"):  # the caller flushes (a retrying reset)
            request.flush_cache = False
        ok, message, *_ = await self.guard(self._tm.update_weights_from_disk(request, None))
        return bool(ok), str(message)

    @override
    async def raw_generate(self, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        engine = self._supervision.engine
        assert engine is not None
        outs: list[dict[str, Any]] = await self.guard(engine.async_generate(**body))
        return outs

    # --- LoRA ----------------------------------------------------------------------------------

    @override
    async def load_lora(self, name: str, path: str) -> tuple[bool, str]:
        obj = _io().LoadLoRAAdapterReqInput(lora_name=name, lora_path=path)
        out = await self.guard(self._tm.load_lora_adapter(obj, None))
        return bool(out.success), str(out.error_message)

    @override
    async def unload_lora(self, name: str) -> tuple[bool, str]:
        out = await self.guard(self._tm.unload_lora_adapter(_io().UnloadLoRAAdapterReqInput(lora_name=name), None))
        return bool(out.success), str(out.error_message)

    @override
    def lora_names(self) -> set[str]:
        self.alive()
        return set(self._tm.lora_registry.get_all_adapters())


def _sent(state: Any) -> bool:
    """Whether the tokenizer manager sent this request state's request to the scheduler: SGLang
    0.5.2x marks ``dispatched``; 0.5.16 stamps ``time_stats.api_server_dispatch_finish_time``."""
    dispatched = getattr(state, "dispatched", None)
    if dispatched is not None:
        return bool(dispatched)
    return bool(getattr(getattr(state, "time_stats", None), "api_server_dispatch_finish_time", 1.0))
