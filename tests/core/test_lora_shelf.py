"""AdapterShelf: versions, directories and removal once unused (no engine: a recording remover)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.lora import LoraAdapter
from rlinfer_core.lora_shelf import AdapterShelf, ServedAdapter

CONFIG = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}


def _adapter(name: str = "a") -> LoraAdapter:
    tensors = {
        "base_model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 8),
        "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(8, 2),
    }
    return LoraAdapter(name, tensors=tensors, config=CONFIG)


class RecordingRemover:
    def __init__(self) -> None:
        self.removed: list[str] = []

    async def __call__(self, served: ServedAdapter) -> None:
        self.removed.append(served.engine_name)


def test_versions_directories_and_removal_once_unused() -> None:
    async def run() -> None:
        remover = RecordingRemover()
        shelf = AdapterShelf(remover)
        first = shelf.prepare(_adapter())
        assert first.engine_name == "a.v0" and (first.folder / "adapter_model.safetensors").is_file()
        config = json.loads((first.folder / "adapter_config.json").read_text())
        assert config["r"] == 2 and config["peft_type"] == "LORA"
        await shelf.put(first)
        in_flight = shelf.acquire("a")
        assert in_flight is first and first.users == 1
        second = shelf.prepare(_adapter())
        assert second.engine_name == "a.v1" and second.engine_id != first.engine_id
        await shelf.put(second)
        assert remover.removed == [], "a request still uses v0"
        assert shelf.acquire("a") is second
        await shelf.done(in_flight)
        assert remover.removed == ["a.v0"] and not first.folder.exists()
        await shelf.done(second)
        await shelf.unload("a")
        assert remover.removed == ["a.v0", "a.v1"] and shelf.live() == []
        folder: Path = second.folder
        shelf.close()
        assert not folder.parent.exists()

    asyncio.run(run())


def test_unknown_name_is_an_invalid_request_and_none_is_the_base() -> None:
    shelf = AdapterShelf(RecordingRemover())
    assert shelf.acquire(None) is None
    with pytest.raises(InvalidRequest, match="no adapter named 'b'"):
        shelf.acquire("b")


def test_discard_drops_the_directory_of_a_refused_adapter() -> None:
    shelf = AdapterShelf(RecordingRemover())
    served = shelf.prepare(_adapter())
    shelf.discard(served)
    assert not served.folder.exists() and shelf.live() == []
    shelf.close()
