"""Servers for the dialect suites (helpers; fixtures in conftest.py): the engine's own server and
``rlinfer serve --dialect X`` over each backend, each started once per session as a subprocess from its own environment.

``RLINFER_DIALECT_SERVERS`` (comma-separated) picks the servers a run covers; the default is every
one-engine server (``rlinfer-X-pool``, a 2-replica pool on a local Ray, only when named). Every
server serves the same tiny float32 model on CPU with the same small KV cache, so greedy outputs
can be compared with the Hugging Face oracle of that model.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
VENVS = ROOT / ".venvs"
API_KEY = "dialect-suite-control-key-0123456789"
START_TIMEOUT_S = 600.0
#: the same engine settings on every server: the tiny model's whole context (room for the long
#: requests the interruption tests end while they decode), the kit's cache and batch sizes
MAX_MODEL_LEN = 1024
KV_CACHE_BYTES = 64 << 20
MAX_SEQS = 16
#: every server kind of the suites (each suite runs the ones of its dialect)
ALL_KINDS = (
    "sglang-reference",
    "vllm-reference",
    "rlinfer-vllm",
    "rlinfer-sglang",
    "rlinfer-vllm-pool",
    "rlinfer-sglang-pool",
)
#: replicas of a ``rlinfer-X-pool`` server (an rlinfer-ray pool on a local Ray cluster)
POOL_REPLICAS = 2
#: the prompt every suite generates from
PROMPT = [1, 5, 6, 7, 9, 11]


@attrs.frozen
class DialectServer:
    """A running server: its kind, URL, process, log and the headers that pass its control guard."""

    kind: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def is_reference(self) -> bool:
        """True for the engine's own server (not rlinfer)."""
        return self.kind.endswith("-reference")

    @property
    def headers(self) -> dict[str, str]:
        """Control headers (an engine server started without a key ignores them)."""
        return {"Authorization": f"Bearer {API_KEY}"}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        """An httpx client on this server with the control headers."""
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)


def selected(all_kinds: tuple[str, ...]) -> list[str]:
    """The server kinds of this run (``RLINFER_DIALECT_SERVERS``; default: every single-engine
    kind, pools only when named)."""
    wanted = os.environ.get("RLINFER_DIALECT_SERVERS")
    if not wanted:
        return [k for k in all_kinds if not k.endswith("-pool")]
    kinds = [k.strip() for k in wanted.split(",") if k.strip()]
    unknown = set(kinds) - set(ALL_KINDS)
    if unknown:
        raise pytest.UsageError(f"RLINFER_DIALECT_SERVERS: unknown {sorted(unknown)}; known {list(ALL_KINDS)}")
    return [k for k in kinds if k in all_kinds]


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    from rlinfer_core.transfer.broadcast import free_port as free

    return free()


def rlinfer_serve_command(kind: str, model: Path, dialect: str, ready: Path) -> list[str]:
    """``rlinfer serve --dialect DIALECT`` for a server kind ``rlinfer-BACKEND`` (one engine) or
    ``rlinfer-BACKEND-pool`` (a pool of POOL_REPLICAS), from that backend's environment."""
    backend, _, pool = kind.removeprefix("rlinfer-").partition("-")
    replicas = ["--replicas", str(POOL_REPLICAS)] if pool == "pool" else []
    return [
        str(VENVS / backend / "bin" / "rlinfer"),
        "serve",
        "--backend",
        backend,
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--set",
        f"max_model_len={MAX_MODEL_LEN}",
        "--set",
        f"kv_cache_memory_bytes={KV_CACHE_BYTES}",
        "--set",
        f"max_num_seqs={MAX_SEQS}",
        "--set",
        "seed=0",
        "--port",
        "0",
        "--ready-file",
        str(ready),
        "--api-key",
        API_KEY,
        "--dialect",
        dialect,
        "--log-level",
        "warning",
        *replicas,
    ]


def _wait_for_health(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(1.0)
    _stop(proc)
    pytest.fail(f"server did not start (rc={proc.poll()}):\n{log.read_text()[-4000:]}")


def _wait_for_ready_file(ready: Path, proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            pytest.fail(f"rlinfer serve did not start (rc={proc.poll()}):\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    info = json.loads(ready.read_text())
    return f"http://{info['host']}:{info['port']}"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the engine's own children too
    proc.wait(timeout=30)


@contextlib.contextmanager
def started(
    kind: str, command: list[str], env: dict[str, str], tmp: Path, ready: Path | None, url: str | None
) -> Iterator[DialectServer]:
    """Start ``command`` in its own session; yield once it serves; stop it and its children."""
    log = tmp / f"{kind}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    if ready is not None:
        url = _wait_for_ready_file(ready, proc, log)
    assert url is not None
    _wait_for_health(url, proc, log)
    try:
        yield DialectServer(kind, url, proc, log)
    finally:
        _stop(proc)


class Oracle:
    """Greedy tokens and their logprobs from the Hugging Face model (float32, CPU)."""

    def __init__(self) -> None:
        self._models: dict[Path, Any] = {}
        self._lock = threading.Lock()

    def _model(self, model_dir: Path) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        with self._lock:
            if model_dir not in self._models:
                self._models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
            return self._models[model_dir]

    def log_softmax(self, model_dir: Path, ids: list[int]) -> Any:
        """``[len(ids), vocab]`` float64 log-probabilities of the next token after each prefix."""
        import torch

        with torch.no_grad():
            logits = self._model(model_dir)(torch.tensor([ids])).logits[0].double()
        return torch.log_softmax(logits, dim=-1)

    def greedy(self, model_dir: Path, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
        """``steps`` greedy tokens after ``prompt`` and each one's logprob."""
        import torch

        model = self._model(model_dir)
        ids = list(prompt)
        out: list[int] = []
        logprobs: list[float] = []
        with torch.no_grad():
            for _ in range(steps):
                logits = model(torch.tensor([ids])).logits[0, -1].float()
                lp = torch.log_softmax(logits, dim=-1)
                token = int(torch.argmax(lp))
                out.append(token)
                logprobs.append(float(lp[token]))
                ids.append(token)
        return out, logprobs
