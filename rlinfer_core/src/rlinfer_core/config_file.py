"""Engine settings from a YAML or TOML file: a ``rollout:`` section mapping onto EngineConfig.

The layout is the one verl users already write for their rollout engine::

    rollout:
      name: vllm                        # the backend (``--backend`` overrides it)
      model: /models/qwen2.5-0.5b
      dtype: bfloat16
      tensor_model_parallel_size: 1     # verl's name for tensor_parallel_size
      gpu_memory_utilization: 0.5
      max_model_len: 4096
      free_cache_engine: true           # verl's name for enable_memory_release
      engine_kwargs:                    # flat, or verl's per-engine form {vllm: {...}, sglang: {...}}
        swap_space: 4

Keys are :class:`~rlinfer_core.types.EngineConfig` field names plus the verl aliases in
:data:`ALIASES`. Values are structured with cattrs under strict scalar rules (no ``"3"`` for an
int, no ``"yes"`` for a bool); an unknown key or a bad value raises
:class:`~rlinfer_core.errors.InvalidRequest` naming the key, the file and the allowed values.
Command-line values override the file (:func:`engine_config`).

A file may also hold a ``pool:`` section (rlinfer-ray's PoolConfig: ``replicas``, ``policy``, ...).
The core only checks that it is a mapping and hands it on untouched (``RolloutSettings.pool``);
``rlinfer_ray.config_file`` structures it with :func:`structure_attrs` under the same rules.
"""

from __future__ import annotations

import enum
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.types import EngineConfig

_T = TypeVar("_T")

SECTION = "rollout"
#: the rlinfer-ray pool's settings; structured by rlinfer_ray, not here
POOL_SECTION = "pool"
#: the sections a config file may hold
SECTIONS = (SECTION, POOL_SECTION)
#: verl's rollout key -> EngineConfig field
ALIASES: Mapping[str, str] = {
    "tensor_model_parallel_size": "tensor_parallel_size",
    "free_cache_engine": "enable_memory_release",
}
#: rollout keys that are not EngineConfig fields
BACKEND_KEY = "name"
_PLACEHOLDER_MODEL = "<model from the command line>"


@attrs.frozen
class RolloutSettings:
    """The ``rollout:`` section of a config file, keys checked and values validated.

    ``fields`` holds EngineConfig field names (aliases resolved) with the file's values;
    ``backend`` is the section's ``name`` (None when absent); ``pool`` is the file's ``pool:``
    section as written (None when absent), for rlinfer_ray to structure.
    """

    path: str
    backend: str | None
    fields: Mapping[str, Any]
    pool: Mapping[str, Any] | None = None


def _strict(kind: type, what: str) -> Any:
    def hook(value: Any, _type: Any) -> Any:
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise TypeError(f"must be {what}, got {value!r}")
        return value

    return hook


def _converter() -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=True)
    converter.register_structure_hook(int, _strict(int, "an integer"))
    converter.register_structure_hook(float, _strict(float, "a number"))
    converter.register_structure_hook(bool, _strict(bool, "true or false"))
    converter.register_structure_hook(str, _strict(str, "a string"))
    return converter


_CONVERTER = _converter()
_FIELDS = {f.name: f for f in attrs.fields(EngineConfig)}


def allowed_keys() -> list[str]:
    """Every key the ``rollout:`` section accepts."""
    return sorted([*_FIELDS, *ALIASES, BACKEND_KEY])


def _allowed_values(cls: type, field: str) -> str:
    hints = typing.get_type_hints(cls)
    hint = hints.get(field)
    if typing.get_origin(hint) is typing.Literal:
        return f"; allowed values: {list(typing.get_args(hint))}"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return f"; allowed values: {[m.value for m in hint]}"
    return ""


def _field_of(exc: BaseException) -> str | None:
    if isinstance(exc, InvalidRequest):
        return exc.field
    for note in getattr(exc, "__notes__", []):
        name = getattr(note, "name", None)
        if isinstance(name, str):
            return name
    return None


def _leaf_errors(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaf_errors(sub)]
    return [exc]


def structure(fields: Mapping[str, Any], where: str) -> EngineConfig:
    """Build an EngineConfig from ``fields`` with cattrs; errors name the key (``where``: its origin)."""
    return structure_attrs(EngineConfig, fields, where, allowed_keys())


def structure_attrs(cls: type[_T], fields: Mapping[str, Any], where: str, allowed: Sequence[str]) -> _T:
    """Build the attrs class ``cls`` from ``fields`` under the strict rules of this module.

    An unknown key or a bad value raises InvalidRequest naming the key, ``where`` and the
    ``allowed`` keys (or the allowed values of a Literal or enum field).
    """
    unknown = sorted(set(fields) - {f.name for f in attrs.fields(cls)})  # type: ignore[arg-type]
    if unknown:
        raise InvalidRequest(unknown[0], f"unknown key in {where}; allowed keys: {list(allowed)}")
    try:
        return _CONVERTER.structure(dict(fields), cls)
    except Exception as exc:
        leaves = _leaf_errors(exc)
        first = leaves[0]
        field = _field_of(first) or "config"
        if isinstance(first, InvalidRequest):
            message = str(first).removeprefix(f"invalid {first.field}: ")
        elif "not in literal" in str(first) or (isinstance(first, ValueError) and "is not a valid" in str(first)):
            message = f"got {fields.get(field)!r}"
        else:
            message = str(first)
        raise InvalidRequest(field, f"{message} (in {where}){_allowed_values(cls, field)}") from exc


def _load(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        import yaml

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise InvalidRequest("config", f"{path} is not valid YAML: {exc}") from None
    if suffix == ".toml":
        import tomllib

        try:
            return tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise InvalidRequest("config", f"{path} is not valid TOML: {exc}") from None
    raise InvalidRequest("config", f"{path}: the file name must end in .yaml, .yml or .toml")


def _engine_kwargs(value: Any, backend: str | None, where: str) -> Any:
    """verl's per-engine form ``{vllm: {...}, sglang: {...}}`` -> the backend's own mapping."""
    if not isinstance(value, Mapping):
        raise InvalidRequest("engine_kwargs", f"must be a mapping (in {where}), got {value!r}")
    if backend is not None and backend in value and all(isinstance(v, Mapping) for v in value.values()):
        return dict(value[backend])
    return dict(value)


def read_config_file(path: str | Path) -> RolloutSettings:
    """Read and check a config file's ``rollout:`` section (see the module docstring)."""
    file = Path(path)
    if not file.is_file():
        raise InvalidRequest("config", f"no such file: {file}")
    data = _load(file)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise InvalidRequest("config", f"{file} must hold a mapping with a {SECTION!r} section")
    extra = sorted(set(data) - set(SECTIONS))
    if extra:
        raise InvalidRequest(str(extra[0]), f"unknown section in {file}; allowed sections: {list(SECTIONS)}")
    section = data.get(SECTION) or {}
    where = f"{file} [{SECTION}]"
    if not isinstance(section, Mapping):
        raise InvalidRequest(SECTION, f"must be a mapping in {file}, got {section!r}")
    backend = section.get(BACKEND_KEY)
    if backend is not None and not (isinstance(backend, str) and backend):
        raise InvalidRequest(BACKEND_KEY, f"must be a backend name (in {where}), got {backend!r}")
    fields: dict[str, Any] = {}
    for key, value in section.items():
        if key == BACKEND_KEY:
            continue
        name = ALIASES.get(str(key), str(key))
        if name in fields:
            raise InvalidRequest(str(key), f"given twice in {where} (as {name!r} and its verl alias)")
        if name == "engine_kwargs":
            value = _engine_kwargs(value, backend, where)
        fields[name] = value
    structure({"model": _PLACEHOLDER_MODEL, **fields}, where)  # validate now, with the file's name in errors
    pool = data.get(POOL_SECTION)
    if pool is not None and not isinstance(pool, Mapping):
        raise InvalidRequest(POOL_SECTION, f"must be a mapping in {file}, got {pool!r}")
    return RolloutSettings(path=str(file), backend=backend, fields=fields, pool=pool)


def engine_config(
    settings: RolloutSettings | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """``defaults``, then the file's ``settings``, then ``overrides`` (command-line flags; None
    values are ignored), structured into one EngineConfig. ``engine_kwargs`` mappings merge."""
    merged: dict[str, Any] = dict(defaults or {})
    layers = [settings.fields if settings else {}, {k: v for k, v in (overrides or {}).items() if v is not None}]
    for layer in layers:
        for key, value in layer.items():
            if key == "engine_kwargs" and isinstance(value, Mapping):
                merged[key] = {**merged.get(key, {}), **value}
            else:
                merged[key] = value
    if "model" not in merged:
        source = f" or in {settings.path}" if settings else ""
        raise InvalidRequest("model", f"give a model directory: --model DIR{source} (rollout.model)")
    where = "the command line" + (f" and {settings.path}" if settings else "")
    return structure(merged, where)


def from_file(path: str | Path, **overrides: Any) -> EngineConfig:
    """EngineConfig from a config file's ``rollout:`` section, with ``overrides`` on top."""
    return engine_config(read_config_file(path), overrides)
