"""dev/gpu/build_bundle.py parses its documented command lines (no engine argument: every
engine) without downloading anything: ``build`` is replaced by a recorder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "dev" / "gpu" / "build_bundle.py"


@pytest.fixture
def bundle(monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, list[str]]:
    spec = importlib.util.spec_from_file_location("build_bundle_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    built: list[str] = []

    def fake_build(recipe: Any, out: Path, image: set[str], part_mib: int, reuse: bool) -> dict[str, object]:
        built.append(next(name for name, r in module.RECIPES.items() if r is recipe))
        return {"wheels": 0, "downloaded_mib": 0, "bundle_mib": 0, "parts": {}}

    monkeypatch.setattr(module, "build", fake_build)
    monkeypatch.setattr(module, "image_packages", lambda path: set())
    return module, built


def test_no_engine_argument_builds_every_bundle(bundle: tuple[ModuleType, list[str]]) -> None:
    module, built = bundle
    assert module.main([]) == 0
    assert built == sorted(module.RECIPES) == ["ray", "sglang", "vllm"]


def test_one_engine_and_an_unknown_one(bundle: tuple[ModuleType, list[str]]) -> None:
    module, built = bundle
    assert module.main(["vllm"]) == 0
    assert built == ["vllm"]
    with pytest.raises(SystemExit) as info:
        module.main(["vllm", "nope"])
    assert info.value.code == 2
    assert built == ["vllm"], "nothing is built when an argument is wrong"
