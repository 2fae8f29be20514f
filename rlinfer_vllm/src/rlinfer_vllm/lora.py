"""LoRA adapters for the vLLM backend (capability ``lora``), over vLLM's own LoRA support.

vLLM serves LoRA only when the engine starts with ``enable_lora=True`` (and ``max_lora_rank``
at least the adapters' rank; ``max_loras`` adapters per batch): pass them in
``EngineConfig.engine_kwargs``. The backend claims ``lora`` only on such an engine.

Each load is one vLLM adapter (``LoRARequest(name, int_id, path)``) with a fresh integer id and
its own vLLM name ``<name>.v<version>``: an adapter given as tensors is written to a temporary
PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``); a PEFT directory is
linked under a versioned path. An in-place update loads the new weights under a new id and name,
switches the rlinfer name to it, and removes the old adapter once no request in flight uses it.
vLLM's prefix-cache keys include the adapter's name and path, so no block computed with the old
weights is ever reused.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core.errors import InvalidRequest, RLInferError, UnsupportedCapability
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.types import Capability, GenerateRequest, LogprobsMode

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

#: why prompt logprobs (and so raw logprobs and scoring) are refused under an adapter
PROMPT_LOGPROBS_LORA = (
    "not with a LoRA adapter: vLLM 0.32 applies the adapter's logits path to prompt positions with the "
    "sampler's per-request indices, and the engine core dies (einsum shape error in punica bgmv_shrink) "
    "when such a request shares a batch with others; use the base weights for prompt/raw logprobs and score"
)

#: PEFT config fields vLLM reads, with PEFT's defaults (a tensors adapter's config may omit them)
PEFT_DEFAULTS: dict[str, Any] = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "lora_dropout": 0.0,
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "modules_to_save": None,
}


@attrs.define
class Served:
    """One vLLM adapter: its request, and how many requests in flight use it."""

    request: LoRARequest
    folder: Path
    users: int = 0
    retired: bool = False  #: replaced by an update; removed from vLLM when ``users`` drops to 0


class LoraHooks:
    """``rlinfer_load_lora`` / ``rlinfer_unload_lora`` / ``rlinfer_list_loras`` and the per-request
    adapter lookup; mixed into :class:`rlinfer_vllm.backend.VllmBackend`."""

    _lora_dir: Path | None = None
    _lora_ids = 0
    _lora_live: dict[str, Served]
    _lora_all: dict[int, Served]

    def _alive(self) -> AsyncLLM:
        raise NotImplementedError

    def _lora_init(self) -> None:
        self._lora_live = {}
        self._lora_all = {}

    def _lora_folder(self, name: str, version: int) -> Path:
        if self._lora_dir is None:
            self._lora_dir = Path(tempfile.mkdtemp(prefix="rlinfer-vllm-lora-"))
        folder = self._lora_dir / f"{name}.v{version}"
        if folder.is_symlink() or folder.is_file():
            folder.unlink()
        elif folder.exists():
            shutil.rmtree(folder)
        return folder

    @staticmethod
    def _write_peft(folder: Path, adapter: LoraAdapter) -> None:
        if adapter.path is not None:
            folder.symlink_to(Path(adapter.path).resolve(), target_is_directory=True)
            return
        from safetensors.torch import save_file

        assert adapter.tensors is not None and adapter.config is not None
        folder.mkdir(parents=True)
        config = {**PEFT_DEFAULTS, **dict(adapter.config)}
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1, default=list))
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in adapter.tensors.items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"))

    @hookimpl
    async def rlinfer_load_lora(self, adapter: LoraAdapter, replace: bool) -> None:
        """Load ``adapter`` as a new vLLM adapter (``replace``: and switch its name to it)."""
        from vllm.lora.request import LoRARequest

        llm = self._alive()
        old = self._lora_live.get(adapter.name)
        version = 0 if old is None else int(old.request.lora_name.rsplit(".v", 1)[1]) + 1
        folder = self._lora_folder(adapter.name, version)
        self._write_peft(folder, adapter)
        self._lora_ids += 1
        request = LoRARequest(f"{adapter.name}.v{version}", self._lora_ids, str(folder))
        try:
            added = await llm.add_lora(request)
        except Exception as exc:
            _remove(folder)
            raise InvalidRequest("lora", f"vLLM rejected adapter {adapter.name!r}: {exc}") from exc
        if not added:
            _remove(folder)
            raise InvalidRequest("lora", f"vLLM did not load adapter {adapter.name!r}")
        served = Served(request, folder)
        self._lora_live[adapter.name] = served
        self._lora_all[request.lora_int_id] = served
        if old is not None:
            old.retired = True
            await self._lora_release(old)

    @hookimpl
    async def rlinfer_unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (its vLLM adapter goes once no request in flight uses it)."""
        served = self._lora_live.pop(name)
        served.retired = True
        await self._lora_release(served)

    @hookimpl
    async def rlinfer_list_loras(self) -> Sequence[str]:
        """Names of the adapters vLLM holds and rlinfer serves."""
        ids = await self._alive().list_loras()
        return sorted(n for n, s in self._lora_live.items() if s.request.lora_int_id in ids)

    def _lora_acquire(self, request: GenerateRequest) -> Served | None:
        """The adapter a request names, counted as in use until :meth:`_lora_done`."""
        name = request.lora
        if name is None:
            return None
        s = request.sampling
        if s.prompt_logprobs or s.logprobs_mode is LogprobsMode.RAW:
            raise UnsupportedCapability(
                Capability.PROMPT_LOGPROBS.value if s.prompt_logprobs else Capability.LOGPROBS_RAW.value,
                "vllm",
                PROMPT_LOGPROBS_LORA,
            )
        served = self._lora_live.get(name)
        if served is None:
            raise InvalidRequest("lora", f"no adapter named {name!r} is loaded; loaded: {sorted(self._lora_live)}")
        served.users += 1
        return served

    async def _lora_done(self, served: Served | None) -> None:
        if served is not None:
            served.users -= 1
            with contextlib.suppress(RLInferError):  # a dead engine holds no adapters to remove
                await self._lora_release(served)

    async def _lora_release(self, served: Served) -> None:
        if not served.retired or served.users > 0:
            return
        self._lora_all.pop(served.request.lora_int_id, None)
        try:
            await self._alive().remove_lora(served.request.lora_int_id)
        finally:
            _remove(served.folder)

    def _lora_cleanup(self) -> None:
        """Remove the temporary adapter directories (at shutdown)."""
        if self._lora_dir is not None:
            shutil.rmtree(self._lora_dir, ignore_errors=True)
            self._lora_dir = None


def _remove(folder: Path) -> None:
    if folder.is_symlink():
        folder.unlink()
    else:
        shutil.rmtree(folder, ignore_errors=True)
