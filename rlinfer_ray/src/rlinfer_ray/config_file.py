"""The ``pool:`` section of a config file, structured into :class:`~rlinfer_ray.config.PoolConfig`.

The core reads the file and hands the section on untouched
(:attr:`rlinfer_core.config_file.RolloutSettings.pool`); this module structures it under the
core's strict rules (unknown key or bad value: InvalidRequest naming the key, the file and the
allowed values), with command-line values on top::

    rollout:
      name: vllm
      model: /models/qwen2.5-0.5b
    pool:
      replicas: 2
      policy: session          # or its alias "routing" (the --routing flag)
      cpus_per_replica: 1

No Ray import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from rlinfer_core.config_file import POOL_SECTION, RolloutSettings, read_config_file, structure_attrs
from rlinfer_core.errors import InvalidRequest
from rlinfer_ray.config import PoolConfig

#: section key -> PoolConfig field (``routing`` is the ``--routing`` flag's name for ``policy``)
ALIASES: Mapping[str, str] = {"routing": "policy"}


def allowed_keys() -> list[str]:
    """Every key the ``pool:`` section accepts."""
    return sorted([*(f.name for f in attrs.fields(PoolConfig)), *ALIASES])


def _fields(section: Mapping[str, Any], where: str) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for key, value in section.items():
        name = ALIASES.get(str(key), str(key))
        if name in fields:
            raise InvalidRequest(str(key), f"given twice in {where} (as {name!r} and its alias)")
        fields[name] = value
    return fields


def pool_config(
    settings: RolloutSettings | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> PoolConfig:
    """The file's ``pool:`` section (``settings``: the core's read of the file, or the section
    itself), then ``overrides`` (command-line values; None values are ignored), as one PoolConfig."""
    if isinstance(settings, RolloutSettings):
        section: Mapping[str, Any] = settings.pool or {}
        origin = f"{settings.path} [{POOL_SECTION}]"
    else:
        section = settings or {}
        origin = f"the [{POOL_SECTION}] settings"
    fields = _fields(section, origin)
    structure_attrs(PoolConfig, fields, origin, allowed_keys())  # the file's errors name the file
    flags = _fields({k: v for k, v in (overrides or {}).items() if v is not None}, "the command line")
    return structure_attrs(PoolConfig, {**fields, **flags}, f"the command line and {origin}", allowed_keys())


def pool_from_file(path: str | Path, **overrides: Any) -> PoolConfig:
    """PoolConfig from a config file's ``pool:`` section, with ``overrides`` on top."""
    return pool_config(read_config_file(path), overrides)
