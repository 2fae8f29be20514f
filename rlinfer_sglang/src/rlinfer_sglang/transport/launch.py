"""Launch SGLang's own HTTP server (``python -m sglang.launch_server``) as a child process.

The server gets the same ``ServerArgs`` as the in-process engine
(:func:`rlinfer_sglang.config.server_args`: rlinfer's scheduler-side weight loader, its logits
processor, the CPU paths), spelled as ``sglang serve`` options with SGLang's own argument parser
(so each option is the one SGLang defines, and the command line is checked before anything
starts). The environment gets what the in-process backend sets in its own process before the
engine starts: ``SGLANG_USE_CPU_ENGINE=1`` on CPU, ``OMP_NUM_THREADS`` (half the cores unless set)
and ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN`` when only SGLang's context reserve exceeds the
model's length. It binds 127.0.0.1 on a free port (:mod:`rlinfer_core.server_child`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from typing import Any

from rlinfer_core.server_child import ChildServer, command_line
from rlinfer_core.types import EngineConfig
from rlinfer_sglang.capabilities import Platform
from rlinfer_sglang.engine_env import engine_environment

#: SGLang's server entry point (what ``sglang serve`` runs)
SERVER_MODULE = "sglang.launch_server"
#: the server process's role in ``engine_processes`` (HTTP server + SGLang's tokenizer manager)
SERVER_ROLE = "server"
#: ServerArgs on top of the in-process ones: the server's own request log off
SERVER_OVERRIDES: Mapping[str, Any] = {"log_level_http": "warning"}


def _parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser


def server_argv(kwargs: Mapping[str, Any], host: str, port: int) -> list[str]:
    """``sglang serve`` options for ``ServerArgs`` keyword arguments ``kwargs``, checked by SGLang's
    parser; an argument without an option is a :class:`BackendLoadError`."""
    return command_line(_parser(), {**kwargs, **SERVER_OVERRIDES, "host": host, "port": port}, "sglang serve")


def server_env(config: EngineConfig, platform: Platform) -> dict[str, str]:
    """Environment variables the server needs (set in its environment only)."""
    env = engine_environment(config, platform)
    if platform == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    return env


def make_server(argv: list[str], env: Mapping[str, str]) -> ChildServer:
    """The child-process handle of ``python -m sglang.launch_server ARGV``."""
    return ChildServer([sys.executable, "-m", SERVER_MODULE, *argv], "SGLang", env)


def role_of(title: str) -> str:
    """Role of a server child by its process title (``sglang::scheduler`` -> ``scheduler``)."""
    return title.removeprefix("sglang::")
