"""Engine settings from a YAML or TOML file: a ``rollout:`` section mapping onto EngineConfig.

The layout is the one verl users already write for their rollout engine, and verl's own config
files are read as they are::

    model_path: /models/qwen2.5-0.5b    # verl's minimal layout (or model.path, or actor_rollout_ref.model.path)
    rollout:                            # or actor_rollout_ref.rollout (verl's trainer configs)
      name: vllm                        # the backend (``--backend`` overrides it)
      mode: async                       # verl's async/sync: no effect (rlinfer's own is ``serving``)
      dtype: bfloat16
      tensor_model_parallel_size: 1     # verl's name for tensor_parallel_size
      gpu_memory_utilization: 0.5
      prompt_length: 512                # max_prompt_tokens: longer prompts are refused
      response_length: 512              # max_response_tokens and default_sampling.max_tokens
      temperature: 1.0                  # default_sampling (also top_k, top_p, n, do_sample, ...)
      val_kwargs: {temperature: 0}      # validation_sampling
      free_cache_engine: true           # verl's name for enable_memory_release
      engine_kwargs:                    # flat, or verl's per-engine form {vllm: {...}, sglang: {...}}
        swap_space: 4

Keys are :class:`~rlinfer_core.types.EngineConfig` field names (``mode`` excepted: in a file it is
verl's) plus every key of verl's rollout config (:mod:`rlinfer_core.verl_config`: mapped, or
accepted with the reason it has no effect, logged). verl's other top-level sections (``trainer``,
``data``, ``algorithm``...) are ignored with a logged note; ``data.max_prompt_length`` /
``max_response_length`` give the lengths when the section has none, as in verl, and verl's
``${oc.select:...}`` interpolations are resolved. Values are structured with cattrs under strict
scalar rules (no ``"3"`` for an int, no ``"yes"`` for a bool); an unknown key or a bad value
raises :class:`~rlinfer_core.errors.InvalidRequest` naming the key, the file and the allowed
values. Command-line values override the file (:func:`engine_config`).

verl's ``multi_turn`` key is not an engine setting: with ``enable: true`` it is read (with its
tool config file) into ``RolloutSettings.tool_loop``, a :class:`~rlinfer_core.tool_loop.ToolLoopConfig`
for ``engine.run_tool_loop``.

A file may also hold a ``pool:`` section (rlinfer-ray's PoolConfig: ``replicas``, ``policy``, ...).
The core only checks that it is a mapping and hands it on untouched (``RolloutSettings.pool``);
``rlinfer_ray.config_file`` structures it with :func:`structure_attrs` under the same rules.
"""

from __future__ import annotations

import enum
import logging
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs

from rlinfer_core import verl_config as verl
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.tool_loop import ToolLoopConfig
from rlinfer_core.types import EngineConfig, SamplingParams

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

SECTION = "rollout"
#: the rlinfer-ray pool's settings; structured by rlinfer_ray, not here
POOL_SECTION = "pool"
#: the sections a config file may hold
SECTIONS = (SECTION, POOL_SECTION)
#: verl's rollout key -> EngineConfig field
ALIASES: Mapping[str, str] = verl.ALIASES
#: rollout keys that are not EngineConfig fields
BACKEND_KEY = "name"
#: EngineConfig fields a file may not set under their own name (``mode`` is verl's key there)
NOT_IN_FILES = frozenset({"mode"})
#: a file's ``mode`` with one of these values is rlinfer's former name of ``serving`` (files written
#: before ``serving``); verl's ``mode`` takes async / sync
SERVING_VALUES = ("inprocess", "server")
#: EngineConfig fields that hold SamplingParams (a mapping of its fields in a file)
SAMPLING_FIELDS = ("default_sampling", "validation_sampling")
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
    #: what was read but has no effect (verl's other sections, its no-effect keys), one line each
    notes: tuple[str, ...] = ()
    #: the multi-turn tool loop of verl's ``multi_turn`` section (None unless ``enable: true``)
    tool_loop: ToolLoopConfig | None = None


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
    # a mapping of SamplingParams fields, turned into one by EngineConfig's converter
    converter.register_structure_hook(SamplingParams, lambda value, _type: value)
    return converter


_CONVERTER = _converter()
_FIELDS = {f.name: f for f in attrs.fields(EngineConfig)}


def allowed_keys() -> list[str]:
    """Every key the ``rollout:`` section accepts (EngineConfig fields and verl's rollout keys)."""
    return sorted({*_FIELDS, *verl.VERL_ROLLOUT_KEYS, BACKEND_KEY} - (NOT_IN_FILES - verl.VERL_ROLLOUT_KEYS))


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
    if value and all(k in _ENGINE_NAMES for k in value) and all(isinstance(v, Mapping | None) for v in value.values()):
        return {}  # verl's per-engine form without this backend's entry (e.g. every entry empty)
    return dict(value)


#: the engine names of verl's per-engine engine_kwargs
_ENGINE_NAMES = frozenset({"vllm", "sglang", "trtllm", "hf"})


def _model_of(data: Mapping[str, Any], where: str) -> str | None:
    """The model verl's layouts name outside the rollout section: ``model_path``, ``model.path``
    or ``actor_rollout_ref.model.path`` (two that differ: InvalidRequest)."""
    found: dict[str, Any] = {}
    for path in ("model_path", "model.path", "actor_rollout_ref.model.path"):
        ok, value = verl._lookup(data, path)
        if ok and value is not None and value != verl.MISSING:
            value = verl.resolve(value, data, data, path)
            if not (isinstance(value, str) and value):
                raise InvalidRequest(path, f"must be a model directory or name (in {where}), got {value!r}")
            found[path] = value
    if len(set(found.values())) > 1:
        raise InvalidRequest(next(iter(found)), f"the file names two models (in {where}): {found}")
    if not found:
        return None
    model = next(iter(found.values()))
    return str(Path(model).expanduser()) if model.startswith("~") else model


def _section_of(data: Mapping[str, Any], file: Path) -> tuple[Mapping[str, Any], str]:
    """The rollout section (top-level ``rollout:``, else verl's ``actor_rollout_ref.rollout``)
    and its name in messages."""
    if SECTION in data:
        section, name = data.get(SECTION) or {}, SECTION
    else:
        found, nested = verl._lookup(data, "actor_rollout_ref.rollout")
        section, name = (nested or {}, "actor_rollout_ref.rollout") if found else ({}, SECTION)
    if not isinstance(section, Mapping):
        raise InvalidRequest(name, f"must be a mapping in {file}, got {section!r}")
    return section, name


def _verl_lengths(data: Mapping[str, Any], section: Mapping[str, Any]) -> dict[str, Any]:
    """verl's defaults of prompt_length / response_length: data.max_prompt_length /
    data.max_response_length, when the section has none."""
    out: dict[str, Any] = {}
    for key, source in (("prompt_length", "data.max_prompt_length"), ("response_length", "data.max_response_length")):
        found, value = verl._lookup(data, source)
        if key not in section and found and value is not None:
            out[key] = value
    return out


def _translate(
    section: Mapping[str, Any], data: Mapping[str, Any], backend: str | None, where: str, folder: Path
) -> tuple[dict[str, Any], list[str]]:
    """The rollout section's keys as EngineConfig fields, and the keys accepted without effect."""
    fields: dict[str, Any] = {}
    no_effect: list[str] = []
    sampling: dict[str, Any] = {}
    keys = {**_verl_lengths(data, section), **section}
    allowed = allowed_keys()

    def put(name: str, key: str, value: Any) -> None:
        if name in fields:
            raise InvalidRequest(key, f"given twice in {where} (as {name!r} and its verl alias)")
        fields[name] = value

    for raw_key, raw_value in keys.items():
        key = str(raw_key)
        if key == BACKEND_KEY:
            continue
        if key not in allowed:
            raise InvalidRequest(key, f"unknown key in {where}; allowed keys: {allowed}")
        value = verl.resolve(raw_value, data, section, key)
        if value == verl.MISSING:
            continue
        if key == "mode" and value in SERVING_VALUES:
            put("serving", key, value)  # rlinfer's own former name of `serving`
        elif key in verl.NO_EFFECT:
            verl.check_only_values(key, value)
            if key == "enable_sleep_mode" and value is False:
                fields["_no_sleep"] = True
            no_effect.append(key)
        elif key in verl.SAMPLING_KEYS:
            if value is not None:
                sampling[key] = value
        elif key == verl.VALIDATION_SECTION:
            if not isinstance(value, Mapping):
                raise InvalidRequest(key, f"must be a mapping (in {where}), got {value!r}")
            unknown = sorted(set(value) - {*verl.VALIDATION_KEYS, "_target_"})
            if unknown:
                raise InvalidRequest(
                    f"{key}.{unknown[0]}", f"unknown key in {where}; allowed keys: {sorted(verl.VALIDATION_KEYS)}"
                )
            resolved = {k: verl.resolve(v, data, section, f"{key}.{k}") for k, v in value.items()}
            put("validation_sampling", key, verl.sampling_fields(resolved, verl.VALIDATION_KEYS))
        elif key == verl.MULTI_TURN_SECTION:
            fields["_tool_loop"] = _tool_loop(value, data, section, where, folder)
        elif key == "load_format":
            put("load_format", key, verl.load_format(value))
        elif key == "engine_kwargs":
            put("engine_kwargs", key, _engine_kwargs(value, backend, where))
        elif key in SAMPLING_FIELDS:
            if not isinstance(value, Mapping):
                raise InvalidRequest(key, f"must be a mapping of SamplingParams fields (in {where}), got {value!r}")
            put(key, key, dict(value))
        else:
            put(ALIASES.get(key, key), key, value)
    sampling = verl.sampling_fields(sampling, verl.SAMPLING_KEYS)
    if "max_response_tokens" in fields and "max_tokens" not in sampling:
        sampling["max_tokens"] = fields["max_response_tokens"]  # verl: response_length is the default length
    if sampling:
        given = dict(fields.get("default_sampling") or {})
        clash = sorted(set(given) & set(sampling))
        if clash:
            raise InvalidRequest(clash[0], f"given twice in {where} (in default_sampling and as a verl key)")
        fields["default_sampling"] = {**sampling, **given}
    if fields.pop("_no_sleep", False):
        fields["enable_memory_release"] = False  # verl: no sleep mode, nothing to free
    validation = fields.get("validation_sampling")
    if isinstance(validation, dict) and "max_response_tokens" in fields:
        validation.setdefault("max_tokens", fields["max_response_tokens"])
    return fields, no_effect


def _tool_loop(
    value: Any, data: Mapping[str, Any], section: Mapping[str, Any], where: str, folder: Path
) -> ToolLoopConfig | None:
    """verl's ``multi_turn`` section as a ToolLoopConfig (interpolations resolved; the tool config
    path relative to the file's folder); errors name the file."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise InvalidRequest(verl.MULTI_TURN_SECTION, f"must be a mapping (in {where}), got {value!r}")
    resolved = {k: verl.resolve(v, data, section, f"multi_turn.{k}") for k, v in value.items()}
    resolved = {k: v for k, v in resolved.items() if v != verl.MISSING}
    try:
        return ToolLoopConfig.from_verl(resolved, folder)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.field, f"{str(exc).removeprefix(f'invalid {exc.field}: ')} (in {where})") from None


def read_config_file(path: str | Path) -> RolloutSettings:
    """Read and check a config file's rollout section (see the module docstring)."""
    file = Path(path)
    if not file.is_file():
        raise InvalidRequest("config", f"no such file: {file}")
    data = _load(file)
    if data is None:
        data = {}
    return read_config_mapping(data, file)


def read_config_mapping(data: Any, file: str | Path) -> RolloutSettings:
    """Check a config document already loaded (e.g. verl's RolloutConfig given to the rlinfer-verl
    plugin as a mapping); ``file`` names it in errors and anchors relative paths in it."""
    file = Path(file)
    if not isinstance(data, Mapping):
        raise InvalidRequest("config", f"{file} must hold a mapping with a {SECTION!r} section")
    extra = sorted(set(data) - set(SECTIONS) - verl.VERL_TOP_LEVEL)
    if extra:
        allowed = sorted({*SECTIONS, *verl.VERL_TOP_LEVEL})
        raise InvalidRequest(str(extra[0]), f"unknown section in {file}; allowed sections: {allowed}")
    section, name = _section_of(data, file)
    where = f"{file} [{name}]"
    backend = verl.resolve(section.get(BACKEND_KEY), data, section, BACKEND_KEY)
    if backend == verl.MISSING:
        backend = None
    if backend is not None and not (isinstance(backend, str) and backend):
        raise InvalidRequest(BACKEND_KEY, f"must be a backend name (in {where}), got {backend!r}")
    fields, no_effect = _translate(section, data, backend, where, file.parent)
    tool_loop = fields.pop("_tool_loop", None)
    model = _model_of(data, str(file))
    if model is not None:
        if "model" in fields and fields["model"] != model:
            raise InvalidRequest("model", f"the file names two models ({file}): {fields['model']!r} and {model!r}")
        fields.setdefault("model", model)
    structure({"model": _PLACEHOLDER_MODEL, **fields}, where)  # validate now, with the file's name in errors
    pool = data.get(POOL_SECTION)
    if pool is not None and not isinstance(pool, Mapping):
        raise InvalidRequest(POOL_SECTION, f"must be a mapping in {file}, got {pool!r}")
    notes = _notes(data, name, no_effect, file)
    for note in notes:
        logger.info("%s", note)
    return RolloutSettings(path=str(file), backend=backend, fields=fields, pool=pool, notes=notes, tool_loop=tool_loop)


def _notes(data: Mapping[str, Any], section: str, no_effect: list[str], file: Path) -> tuple[str, ...]:
    ignored = sorted(set(data) & verl.VERL_TOP_LEVEL - {"model_path"})
    notes = []
    if section != SECTION and "actor_rollout_ref" in ignored:
        ignored.remove("actor_rollout_ref")
        notes.append(
            f"{file}: the rollout settings are verl's actor_rollout_ref.rollout; "
            "the rest of actor_rollout_ref is ignored"
        )
    if ignored:
        notes.append(f"{file}: verl's sections {ignored} are for verl's trainer; rlinfer ignores them")
    for key in no_effect:
        notes.append(f"{file}: {section}.{key} has no effect here: {verl.NO_EFFECT[key]}")
    return tuple(notes)


def engine_config(
    settings: RolloutSettings | None = None,
    overrides: Mapping[str, Any] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> EngineConfig:
    """``defaults``, then the file's ``settings``, then ``overrides`` (command-line flags; None
    values are ignored), structured into one EngineConfig. ``engine_kwargs`` mappings merge, and
    so do ``default_sampling`` / ``validation_sampling`` given as mappings."""
    merged: dict[str, Any] = dict(defaults or {})
    layers = [settings.fields if settings else {}, {k: v for k, v in (overrides or {}).items() if v is not None}]
    for layer in layers:
        for key, value in layer.items():
            below = merged.get(key, {})
            if key in ("engine_kwargs", *SAMPLING_FIELDS) and isinstance(value, Mapping) and isinstance(below, Mapping):
                merged[key] = {**below, **value}
            else:
                merged[key] = value
    if "model" not in merged:
        source = f" or in {settings.path}" if settings else ""
        raise InvalidRequest("model", f"give a model directory: --model DIR{source} (rollout.model or model_path)")
    where = "the command line" + (f" and {settings.path}" if settings else "")
    return structure(merged, where)


def from_file(path: str | Path, **overrides: Any) -> EngineConfig:
    """EngineConfig from a config file's ``rollout:`` section, with ``overrides`` on top."""
    return engine_config(read_config_file(path), overrides)
