"""The multi-turn tool loop's settings: which tools, which parser, how many turns, how long a tool
may take. Built in Python or from verl's ``multi_turn`` rollout section and its tool config file::

    rollout:
      multi_turn:
        enable: true
        max_assistant_turns: 5
        tool_config_path: tools.yaml      # relative: to the config file's folder, else the cwd
        format: hermes                    # the tool-call parser

    # tools.yaml (verl's tool config)
    tools:
      - class_name: my_pkg.tools.Calculator    # or class_path: my_pkg.tools + class_name: Calculator
        config: {type: native}
        tool_schema: {type: function, function: {name: calc, description: ..., parameters: {...}}}

A tool is either a callable ``async (arguments: dict) -> str`` (:class:`Tool`) or a verl-style
object with async ``create`` / ``execute(instance_id, parameters) -> (response, reward, metrics)``
/ ``release`` (:class:`VerlStyleTool`). Tool classes named in a file are imported only when a
loop starts (:meth:`ToolDefinition.build`), so reading a config never imports user code.
The loop itself is :mod:`rlinfer_core.tool_runner` (``engine.run_tool_loop``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.tools import TOOL_PARSERS, ToolSpec, to_tools

TruncateSide = Literal["left", "right", "middle"]
DEFAULT_MAX_ASSISTANT_TURNS = 5

#: every key of verl's MultiTurnConfig (verl 0.8 and 0.9: verl/workers/config/rollout.py)
VERL_MULTI_TURN_KEYS = frozenset(
    {
        "_target_",
        "enable",
        "max_assistant_turns",
        "tool_config_path",
        "max_user_turns",
        "max_parallel_calls",
        "max_tool_response_length",
        "tool_response_truncate_side",
        "interaction_config_path",
        "use_inference_chat_template",
        "tokenization_sanity_check_mode",
        "format",
        "num_repeat_rollouts",
        "function_tool_path",  # verl 0.9
    }
)
#: rlinfer's own keys in the same section (verl has no tool timeout nor a bound on tools in flight)
RLINFER_MULTI_TURN_KEYS = frozenset({"tool_timeout_s", "max_concurrent_tools"})
#: verl keys -> ToolLoopConfig fields (the rlinfer keys are field names already)
VERL_FIELDS: Mapping[str, str] = {
    "max_assistant_turns": "max_assistant_turns",
    "max_user_turns": "max_tool_rounds",
    "max_parallel_calls": "max_parallel_calls",
    "max_tool_response_length": "max_tool_response_length",
    "tool_response_truncate_side": "tool_response_truncate_side",
    "format": "tool_parser",
}
#: verl keys accepted without effect, and why
VERL_NO_EFFECT: Mapping[str, str] = {
    "_target_": "verl's dataclass target for hydra",
    "use_inference_chat_template": "the session always renders the model's own chat template, incrementally",
    "num_repeat_rollouts": "verl's trainer side: repeat a prompt in the batch for a group",
}
#: verl's tokenization_sanity_check_mode -> ToolLoopConfig.strict (the session's continuity check)
SANITY_CHECK_MODES: Mapping[str, bool] = {"strict": True, "ignore_strippable": False, "disable": False}


@runtime_checkable
class Tool(Protocol):
    """rlinfer's tool interface: called with the call's arguments, returns the text for the model."""

    async def __call__(self, arguments: dict[str, Any]) -> str:
        """Run the tool with the call's ``arguments``; the returned text is the tool message."""
        ...


@runtime_checkable
class VerlStyleTool(Protocol):
    """verl's BaseTool interface (``create`` and ``release`` optional): one instance id per episode;
    ``execute`` returns ``(response, step reward, metrics)``; the response is a string, a mapping
    with ``text`` or an object with a ``text`` attribute."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        """Run the tool for the episode's ``instance_id``; returns (response, reward, metrics)."""
        ...


def _positive_int(field: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(field, f"must be an integer >= 1{' or null' if allow_none else ''}, got {value!r}")


def _int_validator(allow_none: bool = False) -> Any:
    def check(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        _positive_int(attribute.name, value, allow_none=allow_none)

    return check


def _positive_seconds(_instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise InvalidRequest(attribute.name, f"must be a number of seconds > 0, got {value!r}")


def load_object(dotted: str, field: str = "class_name") -> Any:
    """The object at ``dotted`` (``package.module.Name``), imported with importlib."""
    module_name, _, name = dotted.rpartition(".")
    if not module_name or not all(part.isidentifier() for part in dotted.split(".")):
        raise InvalidRequest(field, f"must be a dotted path package.module.Name, got {dotted!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidRequest(field, f"cannot import {module_name!r} (for {dotted!r}): {exc}") from exc
    try:
        return getattr(module, name)
    except AttributeError:
        raise InvalidRequest(field, f"module {module_name!r} has no {name!r}") from None


def _schema_argument(cls: type, schema: dict[str, Any]) -> Any:
    """The tool schema as ``cls`` takes it: verl's pydantic OpenAIFunctionToolSchema for verl's own
    tool classes (they read ``tool_schema.function.name``), the OpenAI mapping otherwise."""
    if any(klass.__module__.split(".")[0] == "verl" for klass in cls.__mro__):
        from verl.tools.schemas import OpenAIFunctionToolSchema

        return OpenAIFunctionToolSchema.model_validate(schema)
    return schema


def _one_spec(value: ToolSpec | Mapping[str, Any]) -> ToolSpec:
    specs = to_tools([value])
    assert specs is not None
    return specs[0]


@attrs.frozen
class ToolDefinition:
    """One tool of the loop: its schema (rendered into the chat template, checked against calls)
    and either an ``implementation`` object or a ``class_path`` to import and construct."""

    spec: ToolSpec = attrs.field(converter=_one_spec)
    class_path: str | None = None
    #: verl's per-tool ``config``: handed to the class's constructor as ``config=``
    config: Mapping[str, Any] = attrs.field(factory=dict, eq=False)
    implementation: Any = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        if (self.class_path is None) == (self.implementation is None):
            raise InvalidRequest("tools", f"tool {self.spec.name!r}: give exactly one of class_path and implementation")
        if self.implementation is not None and not _is_tool(self.implementation):
            raise InvalidRequest(
                "tools", f"tool {self.spec.name!r}: the implementation must be callable or have an execute method"
            )

    @classmethod
    def of(cls, implementation: Any, spec: ToolSpec | Mapping[str, Any] | None = None) -> ToolDefinition:
        """A tool from an object; its schema is ``spec``, else the object's ``tool_schema`` (an
        OpenAI tool mapping, as verl's tools hold it)."""
        schema = spec if spec is not None else getattr(implementation, "tool_schema", None)
        if schema is None:
            raise InvalidRequest("tools", f"{implementation!r} has no tool_schema; give spec=")
        return cls(schema, implementation=implementation)

    def build(self) -> Any:
        """The tool object: ``implementation``, or ``class_path`` imported and constructed with the
        ``config`` and ``tool_schema`` keyword arguments its constructor takes."""
        if self.implementation is not None:
            return self.implementation
        assert self.class_path is not None
        factory = load_object(self.class_path, f"tools[{self.spec.name}].class_name")
        if not isinstance(factory, type):
            return factory if _is_tool(factory) else factory()
        try:
            parameters = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            parameters = {}  # type: ignore[assignment]
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        arguments: dict[str, Any] = {}
        if takes_any or "config" in parameters:
            arguments["config"] = dict(self.config)
        if takes_any or "tool_schema" in parameters:
            arguments["tool_schema"] = _schema_argument(factory, self.spec.to_openai())
        tool = factory(**arguments)
        if not _is_tool(tool):
            raise InvalidRequest(f"tools[{self.spec.name}].class_name", f"{self.class_path} is not callable")
        return tool


def _is_tool(value: Any) -> bool:
    return callable(getattr(value, "execute", None)) or callable(value)


def _to_definitions(value: Any) -> tuple[ToolDefinition, ...]:
    definitions = tuple(value)
    if not all(isinstance(d, ToolDefinition) for d in definitions):
        raise InvalidRequest("tools", "must be ToolDefinition objects (ToolDefinition.of(tool) wraps one)")
    names = [d.spec.name for d in definitions]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools", f"tool names must be unique, got {names}")
    return definitions


def _check_parser(_instance: Any, _attribute: Any, value: Any) -> None:
    if value not in TOOL_PARSERS:
        raise InvalidRequest("tool_parser", f"must be one of {list(TOOL_PARSERS)}, got {value!r}")


@attrs.frozen
class ToolLoopConfig:
    """Settings of :func:`rlinfer_core.tool_runner.run_tool_loop` (``engine.run_tool_loop``).

    The loop generates, runs the parsed calls (at most ``max_parallel_calls`` per turn, at most
    ``max_concurrent_tools`` at once over the batch, each within ``tool_timeout_s``), adds their
    results and generates again, until a turn has no call, ``max_assistant_turns`` model turns
    were generated, or ``max_tool_rounds`` rounds of tool results were added (verl's
    ``max_user_turns``; None: no limit). Tool results longer than ``max_tool_response_length``
    characters are cut on ``tool_response_truncate_side``. ``strict``: the session's template
    continuity check (see :mod:`rlinfer_core.session`).
    """

    tools: tuple[ToolDefinition, ...] = attrs.field(default=(), converter=_to_definitions)
    tool_parser: str = attrs.field(default="hermes", validator=_check_parser)
    max_assistant_turns: int = attrs.field(default=DEFAULT_MAX_ASSISTANT_TURNS, validator=_int_validator())
    max_tool_rounds: int | None = attrs.field(default=None, validator=_int_validator(allow_none=True))
    max_parallel_calls: int = attrs.field(default=1, validator=_int_validator())
    max_tool_response_length: int | None = attrs.field(default=None, validator=_int_validator(allow_none=True))
    tool_response_truncate_side: TruncateSide = attrs.field(default="middle")
    tool_timeout_s: float = attrs.field(default=30.0, validator=_positive_seconds)
    max_concurrent_tools: int = attrs.field(default=32, validator=_int_validator())
    strict: bool = True

    def __attrs_post_init__(self) -> None:
        if self.tool_response_truncate_side not in ("left", "right", "middle"):
            raise InvalidRequest(
                "tool_response_truncate_side",
                f"must be one of ['left', 'right', 'middle'], got {self.tool_response_truncate_side!r}",
            )
        if not isinstance(self.strict, bool):
            raise InvalidRequest("strict", f"must be true or false, got {self.strict!r}")

    @property
    def specs(self) -> tuple[ToolSpec, ...]:
        """The tools' schemas, in order."""
        return tuple(d.spec for d in self.tools)

    def truncate(self, text: str) -> str:
        """``text`` cut to ``max_tool_response_length`` characters (verl's rule), marked as cut."""
        limit = self.max_tool_response_length
        if limit is None or len(text) <= limit:
            return text
        side = self.tool_response_truncate_side
        if side == "left":
            return text[:limit] + "...(truncated)"
        if side == "right":
            return "(truncated)..." + text[-limit:]
        half = limit // 2
        return text[:half] + "...(truncated)..." + text[len(text) - (limit - half) :]

    @classmethod
    def from_verl(cls, section: Mapping[str, Any], base_dir: str | Path | None = None) -> ToolLoopConfig | None:
        """verl's ``multi_turn`` section (None when ``enable`` is not true); its
        ``tool_config_path`` is read with :func:`read_tool_config`, relative to ``base_dir`` (the
        config file's folder), else to the current directory. Errors name ``multi_turn.<key>``."""
        if not isinstance(section, Mapping):
            raise InvalidRequest("multi_turn", f"must be a mapping, got {section!r}")
        allowed = sorted(VERL_MULTI_TURN_KEYS | RLINFER_MULTI_TURN_KEYS)
        unknown = sorted(str(k) for k in set(section) - set(allowed))
        if unknown:
            raise InvalidRequest(f"multi_turn.{unknown[0]}", f"unknown key; allowed keys: {allowed}")
        enable = section.get("enable", False)
        if not isinstance(enable, bool):
            raise InvalidRequest("multi_turn.enable", f"must be true or false, got {enable!r}")
        interaction = section.get("interaction_config_path")
        if interaction is not None:
            raise InvalidRequest(
                "multi_turn.interaction_config_path", "only null: simulated-user interactions are not implemented"
            )
        if section.get("function_tool_path") is not None:
            raise InvalidRequest(
                "multi_turn.function_tool_path",
                "only null: verl's Python-function tools are not loaded by rlinfer; give the tools in tool_config_path",
            )
        fields: dict[str, Any] = {}
        for key, field in VERL_FIELDS.items():
            if section.get(key) is not None:
                fields[field] = section[key]
        for key in RLINFER_MULTI_TURN_KEYS:
            if section.get(key) is not None:
                fields[key] = section[key]
        mode = section.get("tokenization_sanity_check_mode")
        if mode is not None:
            if mode not in SANITY_CHECK_MODES:
                allowed_modes = list(SANITY_CHECK_MODES)
                raise InvalidRequest(
                    "multi_turn.tokenization_sanity_check_mode", f"must be one of {allowed_modes}, got {mode!r}"
                )
            fields["strict"] = SANITY_CHECK_MODES[mode]
        if not enable:
            return None
        path = section.get("tool_config_path")
        if path is not None:
            if not isinstance(path, str) or not path:
                raise InvalidRequest("multi_turn.tool_config_path", f"must be a file path, got {path!r}")
            fields["tools"] = read_tool_config(_find(Path(path).expanduser(), base_dir))
        try:
            return cls(**fields)
        except InvalidRequest as exc:
            key = next((k for k, f in VERL_FIELDS.items() if f == exc.field and k in section), exc.field)
            raise InvalidRequest(f"multi_turn.{key}", str(exc).removeprefix(f"invalid {exc.field}: ")) from None

    @classmethod
    def from_file(cls, path: str | Path) -> ToolLoopConfig:
        """The tool loop of a config file's rollout section (``multi_turn`` with ``enable: true``;
        InvalidRequest when it has none). See :mod:`rlinfer_core.config_file`."""
        from rlinfer_core.config_file import read_config_file

        settings = read_config_file(path)
        if settings.tool_loop is None:
            raise InvalidRequest("multi_turn", f"{path} has no rollout.multi_turn section with enable: true")
        return settings.tool_loop


def _find(path: Path, base_dir: str | Path | None) -> Path:
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [Path(base_dir) / path] if base_dir is not None else []
        candidates.append(Path.cwd() / path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    shown = [str(c) for c in candidates]
    raise InvalidRequest("multi_turn.tool_config_path", f"no such file: {path} (looked for {shown})")


def read_tool_config(path: str | Path) -> tuple[ToolDefinition, ...]:
    """verl's tool config file (YAML): ``tools:``, a list of ``class_name`` (a dotted path; older
    files: ``class_path`` module + ``class_name``), ``config`` (``type: native`` or none) and
    ``tool_schema`` (an OpenAI function tool). Nothing is imported here."""
    import yaml

    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidRequest("tool_config_path", f"cannot read {file}: {exc}") from None
    entries = data.get("tools") if isinstance(data, Mapping) else None
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        raise InvalidRequest("tools", f"{file} must hold a list under 'tools:'")
    return _to_definitions(_definition(entry, i, file) for i, entry in enumerate(entries))


def _definition(entry: Any, i: int, file: Path) -> ToolDefinition:
    where = f"tools[{i}]"
    if not isinstance(entry, Mapping):
        raise InvalidRequest(where, f"must be a mapping (in {file}), got {entry!r}")
    unknown = sorted(set(entry) - {"class_name", "class_path", "config", "tool_schema"})
    if unknown:
        allowed = "class_name, class_path, config, tool_schema"
        raise InvalidRequest(f"{where}.{unknown[0]}", f"unknown key in {file}; allowed: {allowed}")
    name, module = entry.get("class_name"), entry.get("class_path")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"{where}.class_name", f"must be a dotted class path (in {file}), got {name!r}")
    if module is not None:
        if not isinstance(module, str) or not module:
            raise InvalidRequest(f"{where}.class_path", f"must be a module path (in {file}), got {module!r}")
        name = name if name.startswith(module + ".") else f"{module}.{name}"
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise InvalidRequest(f"{where}.config", f"must be a mapping (in {file}), got {config!r}")
    if config.get("type", "native") != "native":
        raise InvalidRequest(
            f"{where}.config.type", f"only native tools run here (in {file}), got {config.get('type')!r}"
        )
    schema = entry.get("tool_schema")
    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"{where}.tool_schema", f"must be an OpenAI function tool (in {file}), got {schema!r}")
    try:
        return ToolDefinition(dict(schema), class_path=name, config=dict(config))
    except InvalidRequest as exc:
        raise InvalidRequest(f"{where}.tool_schema", f"{exc} (in {file})") from None
