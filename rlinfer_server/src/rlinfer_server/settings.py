"""Server settings and the bind/token rules checked before anything starts."""

from __future__ import annotations

import hmac
import ipaddress
import socket

import attrs

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.tools import TOOL_PARSERS

API_KEY_ENV = "RLINFER_API_KEY"
GENERATE_API_KEY_ENV = "RLINFER_GENERATE_API_KEY"
DEFAULT_MAX_BODY_BYTES = 8 << 20
MIN_KEY_LENGTH = 16
#: the HTTP dialects ``rlinfer serve`` speaks (``--dialect``); each adds its routes to the OpenAI surface
DIALECTS = ("openai", "sglang", "vllm")


def is_loopback(host: str) -> bool:
    """True when ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_key(name: str, key: str | None) -> None:
    if key is not None and len(key) < MIN_KEY_LENGTH:
        raise InvalidRequest(name, f"must be at least {MIN_KEY_LENGTH} characters (e.g. `openssl rand -hex 32`)")


@attrs.frozen
class ServerSettings:
    """How ``rlinfer serve`` listens and whom it lets in.

    ``api_key`` guards the control endpoints (and works on every other endpoint too);
    ``generate_api_key``, when set, guards generation, models and metrics. Without ``api_key``
    the control endpoints answer 403. A non-loopback ``host`` needs ``api_key``.
    ``tool_call_parser`` ("hermes", "qwen", "llama": the engine's parser of that format) reads
    tool calls from chat answers with ``tool_choice: "auto"``; ``trust_request_chat_template``
    lets requests bring their own chat template (refused otherwise, as in vLLM).
    ``dialect`` adds an engine server's own routes (``sglang``: ``python -m sglang.launch_server``'s;
    ``vllm``: ``vllm serve``'s RL dev-mode routes) over the same engine; ``open_control`` lets
    control routes through without a key, on a loopback bind only.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = attrs.field(default=None, repr=False)
    generate_api_key: str | None = attrs.field(default=None, repr=False)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_model_name: str = "model"
    tool_call_parser: str | None = None
    trust_request_chat_template: bool = False
    dialect: str = "openai"
    open_control: bool = False

    def check(self) -> None:
        """Refuse unsafe or impossible settings (InvalidRequest naming the option)."""
        _check_key("api_key", self.api_key)
        _check_key("generate_api_key", self.generate_api_key)
        if self.dialect not in DIALECTS:
            raise InvalidRequest("dialect", f"must be one of {list(DIALECTS)}, got {self.dialect!r}")
        if self.open_control and not is_loopback(self.host):
            raise InvalidRequest(
                "open_control",
                f"control routes without a key are served on a loopback bind only, not on {self.host!r}; "
                "give --api-key instead",
            )
        if not is_loopback(self.host) and not self.api_key:
            raise InvalidRequest(
                "host",
                f"binding {self.host!r} exposes the server beyond this machine; give --api-key "
                f"(or ${API_KEY_ENV}) so that the control endpoints are guarded, or bind 127.0.0.1",
            )
        if not 0 <= self.port <= 65535:
            raise InvalidRequest("port", f"must be in [0, 65535], got {self.port}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise InvalidRequest(
                "tool_call_parser", f"must be one of {list(TOOL_PARSERS)}, got {self.tool_call_parser!r}"
            )
        if self.max_body_bytes < 1024:
            raise InvalidRequest("max_body_bytes", f"must be >= 1024, got {self.max_body_bytes}")

    def bind(self) -> socket.socket:
        """A listening-ready socket on ``host:port`` (port 0: a free one)."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
            sock.listen(2048)  # connections wait in the backlog while the engine starts
        except OSError as exc:
            sock.close()
            raise InvalidRequest("port", f"cannot bind {self.host}:{self.port}: {exc}") from None
        return sock


def token_matches(header: str | None, key: str | None) -> bool:
    """True when an ``Authorization: Bearer KEY`` header carries ``key`` (constant-time)."""
    if key is None or header is None:
        return False
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())
