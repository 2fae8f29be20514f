"""verl's rollout config (``actor_rollout_ref.rollout`` with ``name: rlinfer``) as an rlinfer engine.

verl hands the plugin its ``RolloutConfig`` (a dataclass, or the DictConfig it comes from). Its
keys are read by :func:`rlinfer_core.config_file.read_config_mapping`, the same reader as a verl
config file's (the key table: docs/verl.md). What is rlinfer's own sits in verl's free-form
extension point, ``rollout.custom.rlinfer``::

    actor_rollout_ref:
      rollout:
        name: rlinfer
        custom:
          rlinfer:
            backend: vllm            # or sglang (default: vllm)
            serving: inprocess       # or server: the engine's own HTTP server as a child
            pool: {replicas: 2}      # optional: an rlinfer-ray pool instead of one engine
            http: {port: 0}          # optional: rlinfer serve over the engine (verl's server_address)
            kv_cache_memory_bytes: 67108864   # any other EngineConfig field

The engine settings that verl's section names (``engine_kwargs.vllm`` / ``engine_kwargs.sglang``
included) apply to the chosen backend; the ``custom.rlinfer`` fields win over them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from rlinfer_core.config_file import engine_config, read_config_mapping
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import EngineConfig

#: verl's rollout.name for this plugin
ROLLOUT_NAME = "rlinfer"
#: where rlinfer's own settings are, inside verl's ``rollout.custom``
CUSTOM_KEY = "rlinfer"
#: the backend when ``custom.rlinfer.backend`` is not given
DEFAULT_BACKEND = "vllm"
_WHERE = "verl's actor_rollout_ref.rollout"


@attrs.frozen
class RlinferRollout:
    """What one verl rollout section asks of rlinfer: the backend, the engine's config, and the
    pool's settings when the section has ``custom.rlinfer.pool`` (None: one engine)."""

    backend: str
    engine: EngineConfig
    pool: Mapping[str, Any] | None = None
    #: rlinfer serve's settings when the section has ``custom.rlinfer.http`` (None: no HTTP server)
    http: Mapping[str, Any] | None = None
    #: what verl's section sets that has no effect here, one line each (logged)
    notes: tuple[str, ...] = ()


def plain(value: Any) -> Any:
    """verl's config (dataclasses, OmegaConf containers) as plain dicts and lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        pass
    else:
        if isinstance(value, DictConfig | ListConfig):
            return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def rlinfer_rollout(rollout_config: Any, model_path: str) -> RlinferRollout:
    """Read verl's rollout section (``name: rlinfer``) for the model at ``model_path``.

    Every verl key is mapped or accepted with its stated reason, as for a verl config file;
    errors are InvalidRequest naming the key.
    """
    section = dict(plain(rollout_config))
    name = section.pop("name", ROLLOUT_NAME)
    if name != ROLLOUT_NAME:
        raise InvalidRequest("name", f"the rlinfer-verl plugin serves rollout.name {ROLLOUT_NAME!r}, got {name!r}")
    custom = dict(section.get("custom") or {})
    own = custom.pop(CUSTOM_KEY, None) or {}
    if not isinstance(own, Mapping):
        raise InvalidRequest(f"custom.{CUSTOM_KEY}", f"must be a mapping (in {_WHERE}), got {own!r}")
    own = dict(own)
    section["custom"] = custom or None
    backend = own.pop("backend", DEFAULT_BACKEND)
    if not isinstance(backend, str) or not backend:
        raise InvalidRequest(f"custom.{CUSTOM_KEY}.backend", f"must be a backend name (vllm, sglang), got {backend!r}")
    pool = own.pop("pool", None)
    if pool is not None and not isinstance(pool, Mapping):
        raise InvalidRequest(f"custom.{CUSTOM_KEY}.pool", f"must be a mapping of pool settings, got {pool!r}")
    http = own.pop("http", None)
    if http is True:
        http = {}
    if http is not None and not isinstance(http, Mapping):
        raise InvalidRequest(
            f"custom.{CUSTOM_KEY}.http", f"must be true or a mapping of rlinfer serve settings, got {http!r}"
        )
    section["name"] = backend
    document: dict[str, Any] = {"model_path": model_path, "rollout": section}
    settings = read_config_mapping(document, Path(_WHERE))
    unknown = sorted(set(own) - {f.name for f in attrs.fields(EngineConfig)})
    if unknown:
        allowed = sorted({"backend", "pool", "http", *(f.name for f in attrs.fields(EngineConfig))})
        raise InvalidRequest(f"custom.{CUSTOM_KEY}.{unknown[0]}", f"unknown key; allowed keys: {allowed}")
    config = engine_config(settings, own)
    http_fields = dict(http) if http is not None else None
    return RlinferRollout(backend=backend, engine=config, pool=pool, http=http_fields, notes=settings.notes)
