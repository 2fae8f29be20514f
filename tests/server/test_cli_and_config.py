"""No engine: the command plugin group, config-file errors, and the bind/token rules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlinfer_core.config_file import read_config_file
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import EngineConfig
from rlinfer_server.settings import ServerSettings


def _rlinfer(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlinfer_core.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_commands_come_from_the_entry_point_group() -> None:
    done = _rlinfer("--help")
    assert done.returncode == 0
    for name in ("backends", "bench", "conformance", "demo", "serve"):
        assert name in done.stdout


def test_a_broken_command_plugin_is_a_load_error(tmp_path: Path) -> None:
    info = tmp_path / "rlinfer_broken_cmd-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rlinfer-broken-cmd\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlinfer.commands]\nbroken = no_such_module:register\n")
    env = {"PYTHONPATH": str(tmp_path)}
    assert "serve" in _rlinfer("--help", env=env).stdout
    report = json.loads(_rlinfer("backends", "--json", env=env).stdout)
    errors = {e["name"]: e for e in report["load_errors"]}
    assert errors["broken"]["group"] == "rlinfer.commands"
    assert errors["broken"]["distribution"] == "rlinfer-broken-cmd 0.1"
    assert "no_such_module" in errors["broken"]["error"]
    done = _rlinfer("broken", env=env)
    assert done.returncode == 1 and "failed to load" in done.stderr


def test_the_core_does_not_import_the_kit_or_the_server() -> None:
    heavy = ("rlinfer_conformance.plugin", "fastapi", "uvicorn", "torch")
    code = (
        "import sys, rlinfer_core.cli as c; c.build_parser(); "
        f"print(sorted(m for m in sys.modules if m.startswith({heavy!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr


@pytest.mark.parametrize(
    "body,field,needle",
    [
        ("rollout:\n  foo: 1\n", "foo", "allowed keys"),
        ("rollout:\n  dtype: bf16\n", "dtype", "'float32'"),
        ("rollout:\n  max_model_len: '512'\n", "max_model_len", "an integer"),
        ("rollout:\n  enforce_eager: 'yes'\n", "enforce_eager", "true or false"),
        ("rollout:\n  gpu_memory_utilization: 1.5\n", "gpu_memory_utilization", "<= 1.0"),
        ("nosuch: {}\n", "nosuch", "allowed sections"),
        (
            "rollout:\n  tensor_parallel_size: 1\n  tensor_model_parallel_size: 1\n",
            "tensor_model_parallel_size",
            "twice",
        ),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, body: str, field: str, needle: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(body)
    with pytest.raises(InvalidRequest) as info:
        read_config_file(path)
    assert info.value.field == field and needle in str(info.value) and str(path) in str(info.value)


def test_toml_yaml_aliases_and_overrides(tmp_path: Path) -> None:
    (tmp_path / "c.toml").write_text('[rollout]\nname = "vllm"\nmodel = "/m"\ntensor_model_parallel_size = 2\n')
    config = EngineConfig.from_file(str(tmp_path / "c.toml"), tensor_parallel_size=1)
    assert config.model == "/m" and config.tensor_parallel_size == 1
    (tmp_path / "c.yaml").write_text(
        "rollout:\n  model: /m\n  free_cache_engine: true\n  engine_kwargs: {vllm: {a: 1}}\n  name: vllm\n"
    )
    config = EngineConfig.from_file(str(tmp_path / "c.yaml"))
    assert config.enable_memory_release is True and dict(config.engine_kwargs) == {"a": 1}
    assert read_config_file(tmp_path / "c.yaml").backend == "vllm"


def test_cli_flags_override_the_file_and_bad_files_fail_fast(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  name: nosuchbackend\n  model: /m\n  max_model_len: 4\n")
    done = _rlinfer("serve", "--config", str(path), "--port", "0")
    assert done.returncode == 1 and "max_model_len" in done.stderr and str(path) in done.stderr
    path.write_text("rollout:\n  name: nosuchbackend\n  model: /m\n  max_model_len: 64\n")
    done = _rlinfer("serve", "--config", str(path), "--set", "max_model_len=4", "--port", "0")
    assert done.returncode == 1 and "max_model_len" in done.stderr and "command line" in done.stderr
    done = _rlinfer("serve", "--config", str(path), "--port", "0")
    assert done.returncode == 1 and "nosuchbackend" in done.stderr  # the backend came from rollout.name


def test_non_loopback_bind_needs_a_key() -> None:
    with pytest.raises(InvalidRequest) as info:
        ServerSettings(host="0.0.0.0").check()
    assert info.value.field == "host"
    ServerSettings(host="0.0.0.0", api_key="k" * 32).check()
    ServerSettings(host="::1").check()
    with pytest.raises(InvalidRequest):
        ServerSettings(api_key="short").check()
    done = _rlinfer("serve", "--backend", "vllm", "--model", "/m", "--host", "0.0.0.0", env={"RLINFER_API_KEY": ""})
    assert done.returncode == 1 and "invalid host" in done.stderr


def test_tool_options_are_checked_before_anything_starts() -> None:
    with pytest.raises(InvalidRequest) as info:
        ServerSettings(tool_call_parser="nope").check()
    assert info.value.field == "tool_call_parser"
    ServerSettings(tool_call_parser="hermes", trust_request_chat_template=True).check()
    done = _rlinfer("serve", "--backend", "vllm", "--model", "/m", "--enable-auto-tool-choice")
    assert done.returncode == 1 and "enable_auto_tool_choice" in done.stderr and "--tool-call-parser" in done.stderr
