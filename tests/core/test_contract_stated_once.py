"""The backend contract is stated once (issue 24): the pluggy hookspecs.

``rlinfer_core.backend``'s protocols are a typed view of them, checked here mechanically: every
operation hookspec has exactly one protocol member with the same parameters (names, kinds,
defaults, annotations) and return type and vice versa, the member's docstring *is* the
hookspec's (not a copy), and the protocols split required from optional hooks exactly as the
hookspecs' ``optional`` markers do. The facade reaches every operation hook, and every optional
one only through ``BackendCalls.optional`` / ``implemented`` with a protocol member (no dispatch by name).
``rlinfer serve`` serves the facade itself (a pool is that facade over rlinfer_ray's
PoolBackend, which has every operation hook). New hookspecs are picked up without a change here.
"""

from __future__ import annotations

import ast
import inspect
import types
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest
from test_sync_surface import import_pool_backend

from rlinfer_core import hookspecs
from rlinfer_core.backend import OPTIONAL, Backend, FullBackend, LoraBackend, ToolsBackend, optional_hook
from rlinfer_core.errors import UnsupportedCapability
from rlinfer_core.types import Capabilities, Capability

if TYPE_CHECKING:  # names the doubles' annotations use (never evaluated)
    from rlinfer_core.lora import LoraAdapter

CORE = Path(__file__).resolve().parents[2] / "rlinfer_core" / "src" / "rlinfer_core"
#: where the contract is stated, not dispatched
CONTRACT_MODULES = ("hookspecs.py", "backend.py")


def operation_specs(module: Any) -> dict[str, Callable[..., Any]]:
    """The operation hookspecs of ``module`` (every ``rlinfer_*`` hookspec but the events)."""
    return {
        name: fn
        for name, fn in vars(module).items()
        if name.startswith("rlinfer_") and not name.startswith("rlinfer_on_") and hasattr(fn, "rlinfer_spec")
    }


def _members(protocol: type) -> list[str]:
    return sorted(n for n in vars(protocol) if n.startswith("rlinfer_"))


def _shape(fn: Callable[..., Any], drop_self: bool) -> tuple[list[tuple[str, Any, Any, Any]], Any]:
    signature = inspect.signature(fn)
    params = list(signature.parameters.values())[1 if drop_self else 0 :]
    return [(p.name, p.kind, p.default, p.annotation) for p in params], signature.return_annotation


def contract_problems(specs: Mapping[str, Callable[..., Any]], required: type, optional: Sequence[type]) -> list[str]:
    """Every way the typed view (``required`` and the ``optional`` protocols) differs from
    ``specs``; empty when the view states nothing the specs do not."""
    problems = [f"hookspec {name} has no docstring" for name, spec in specs.items() if not (spec.__doc__ or "").strip()]
    owners: dict[str, list[type]] = {}
    for protocol in (required, *optional):
        for name in _members(protocol):
            owners.setdefault(name, []).append(protocol)
    for name in sorted(set(specs) - set(owners)):
        problems.append(f"hookspec {name} has no protocol member")
    for name, protocols in sorted(owners.items()):
        spec = specs.get(name)
        if spec is None:
            problems.append(f"{protocols[0].__name__}.{name} is no hookspec")
            continue
        if len(protocols) > 1:
            problems.append(f"{name} is a member of {[p.__name__ for p in protocols]}; one protocol only")
        member = vars(protocols[0])[name]
        (params, returns), (spec_params, spec_returns) = _shape(member, True), _shape(spec, False)
        if params != spec_params:
            problems.append(
                f"{protocols[0].__name__}.{name} parameters {params} differ from the hookspec's {spec_params}"
            )
        if returns != spec_returns:
            problems.append(f"{protocols[0].__name__}.{name} returns {returns}, the hookspec {spec_returns}")
        if member.__doc__ is not spec.__doc__:
            problems.append(
                f"{protocols[0].__name__}.{name} does not take its hookspec's docstring (restated or missing)"
            )
        marked = getattr(spec, hookspecs.OPTIONAL_MARK, None)
        if protocols[0] is required and marked is not None:
            problems.append(f"{name} is optional in the hookspecs but a member of {required.__name__}")
        if protocols[0] is not required and marked is None:
            problems.append(f"{name} is required in the hookspecs but in optional {protocols[0].__name__}")
    for protocol in optional:
        marks = {getattr(specs[n], hookspecs.OPTIONAL_MARK, None) for n in _members(protocol) if n in specs}
        if len(marks) > 1:
            problems.append(f"{protocol.__name__} groups hooks that back different capabilities: {marks}")
    return problems


# --- the real contract --------------------------------------------------------------------------


def test_the_typed_view_states_exactly_the_hookspecs() -> None:
    specs = operation_specs(hookspecs)
    assert "rlinfer_generate" in specs and "rlinfer_load_lora" in specs, "premise: the specs are found"
    assert contract_problems(specs, Backend, OPTIONAL) == []
    assert set(_members_of_all(FullBackend)) == set(specs), "FullBackend holds every operation hook"


def _members_of_all(protocol: type) -> list[str]:
    return [n for n in dir(protocol) if n.startswith("rlinfer_")]


def test_every_optional_hook_backs_what_its_marker_says() -> None:
    """The markers are the one statement of optionality: tools and LoRA included."""
    specs = operation_specs(hookspecs)
    marks = {name: getattr(spec, hookspecs.OPTIONAL_MARK, None) for name, spec in specs.items()}
    assert marks["rlinfer_generate"] is None and marks["rlinfer_update_weights"] is None
    assert marks["rlinfer_parse_tool_calls"] == {Capability.TOOLS}
    assert marks["rlinfer_load_lora"] == {Capability.LORA}
    assert marks["rlinfer_abort"] == {Capability.ABORT, Capability.PAUSE_ABORT}
    assert marks["rlinfer_engine_processes"] == frozenset()  # optional outright
    assert "Optional: behind generate.tools." in (ToolsBackend.__doc__ or "")


# --- the check fails on a broken view ----------------------------------------------------------


class BrokenLoraViewDouble(Protocol):
    """TEST-ONLY double: LoraBackend stated wrongly in every way the check must catch."""

    def rlinfer_load_lora(self, adapter: LoraAdapter, in_place: bool) -> Awaitable[None]:  # renamed parameter
        """Load an adapter (a restated docstring)."""
        ...

    def rlinfer_unload_lora(self, name: str) -> Awaitable[bool]: ...  # another return type
    def rlinfer_forget_loras(self) -> Awaitable[None]: ...  # no such hookspec

    # rlinfer_list_loras left out


def test_the_check_catches_a_broken_view() -> None:
    specs = operation_specs(hookspecs)
    # TEST-ONLY double: Backend's members plus the tool parser, which the hookspecs mark optional
    broken_required = type(
        "BrokenRequiredViewDouble",
        (),
        {
            **{n: vars(Backend)[n] for n in _members(Backend)},
            "rlinfer_parse_tool_calls": vars(ToolsBackend)["rlinfer_parse_tool_calls"],
        },
    )
    optional = [p for p in OPTIONAL if p not in (LoraBackend, ToolsBackend)] + [BrokenLoraViewDouble]
    problems = contract_problems(specs, broken_required, optional)
    expected = [
        "hookspec rlinfer_list_loras has no protocol member",
        "BrokenLoraViewDouble.rlinfer_forget_loras is no hookspec",
        "BrokenLoraViewDouble.rlinfer_load_lora parameters",
        "BrokenLoraViewDouble.rlinfer_load_lora does not take its hookspec's docstring",
        "BrokenLoraViewDouble.rlinfer_unload_lora returns Awaitable[bool], the hookspec Awaitable[None]",
        "BrokenLoraViewDouble.rlinfer_unload_lora does not take its hookspec's docstring",  # it has none
        "rlinfer_parse_tool_calls is optional in the hookspecs but a member of BrokenRequiredViewDouble",
    ]
    for start in expected:
        assert any(p.startswith(start) for p in problems), (start, problems)
    assert len(problems) == len(expected), problems


def test_the_check_catches_a_new_hookspec_without_a_view_and_an_unmarked_optional_one() -> None:
    """A hookspec added later is picked up; so is one whose optional marker was forgotten."""
    specs = dict(operation_specs(hookspecs))

    def rlinfer_new_operation(x: int) -> Awaitable[None]:
        """A new hook."""

    specs["rlinfer_new_operation"] = rlinfer_new_operation
    marked = specs["rlinfer_load_lora"]
    unmarked = types.FunctionType(marked.__code__, marked.__globals__, marked.__name__)  # no optional marker
    unmarked.__doc__, unmarked.__annotations__ = marked.__doc__, marked.__annotations__
    specs["rlinfer_load_lora"] = unmarked
    problems = contract_problems(specs, Backend, OPTIONAL)
    assert "hookspec rlinfer_new_operation has no protocol member" in problems
    assert "rlinfer_load_lora is required in the hookspecs but in optional LoraBackend" in problems
    assert any(p.startswith("LoraBackend groups hooks that back different capabilities") for p in problems)


def test_a_protocol_member_that_restates_its_docstring_is_refused_at_import() -> None:
    from rlinfer_core.backend import _view_of_hookspecs

    class RestatingViewDouble(Protocol):
        """TEST-ONLY double."""

        def rlinfer_abort(self, request_ids: Sequence[str] | None) -> Awaitable[None]:
            """Abort requests."""
            ...

    with pytest.raises(TypeError, match=r"RestatingViewDouble.rlinfer_abort restates the docstring"):
        _view_of_hookspecs(RestatingViewDouble)


# --- the facade dispatches every optional hook one way ------------------------------------------


def _facade_hook_uses() -> list[tuple[str, int, ast.Attribute, ast.AST | None]]:
    """Every ``x.rlinfer_<operation>`` in the core outside the contract modules, with its parent."""
    operations = set(operation_specs(hookspecs))
    uses = []
    for path in sorted(CORE.rglob("*.py")):
        if path.name in CONTRACT_MODULES:
            continue
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in operations:
                uses.append((path.name, node.lineno, node, parents.get(node)))
            if isinstance(node, ast.Constant) and node.value in operations:
                uses.append((path.name, node.lineno, ast.Attribute(ast.Name("str"), node.value), None))
    return uses


def test_the_facade_reaches_every_operation_hook_and_optional_ones_only_through_optional() -> None:
    optional_protocols = {p.__name__: p for p in OPTIONAL}
    reached, bad = set(), []
    for module, line, node, parent in _facade_hook_uses():
        reached.add(node.attr)
        marked = getattr(getattr(hookspecs, node.attr), hookspecs.OPTIONAL_MARK, None)
        if marked is None:
            continue  # a required hook: called on the typed backend
        owner = node.value.id if isinstance(node.value, ast.Name) else None
        through = (
            isinstance(parent, ast.Call)
            and node in parent.args[:1]
            and getattr(parent.func, "attr", None) in ("optional", "implemented")
        )
        if owner not in optional_protocols or node.attr not in vars(optional_protocols[owner]) or not through:
            bad.append(f"{module}:{line}: {ast.unparse(parent or node)}")
    assert bad == [], "optional hooks are reached only as optional(<Protocol>.<hook>) or implemented(...):\n" + (
        "\n".join(bad)
    )
    assert reached == set(operation_specs(hookspecs)), "every operation hook is called by the facade"


class AbortOnlyBackendDouble:
    """TEST-ONLY double: implements the abort hook and nothing else."""

    async def rlinfer_abort(self, request_ids: Sequence[str] | None) -> None: ...


def test_an_optional_hook_is_refused_with_the_backends_note_then_for_its_absence() -> None:
    from rlinfer_core.backend import AbortingBackend, PausingBackend, ProcessesBackend, implemented

    double = AbortOnlyBackendDouble()
    caps = Capabilities("double", "0", "cpu", {Capability.PAUSE_ABORT}, {"lora": "no adapters on this platform"})
    with pytest.raises(UnsupportedCapability) as refused:
        optional_hook(double, LoraBackend.rlinfer_load_lora, caps, None, "double")
    assert (refused.value.capability, refused.value.reason) == ("lora", "no adapters on this platform")
    # a hook backing several capabilities: any claimed one, or the one the call needs
    assert optional_hook(double, AbortingBackend.rlinfer_abort, caps, None, "double") == double.rlinfer_abort
    with pytest.raises(UnsupportedCapability) as refused:
        optional_hook(double, AbortingBackend.rlinfer_abort, caps, Capability.ABORT, "double")
    assert refused.value.capability == "abort"
    with pytest.raises(TypeError, match="does not back"):
        optional_hook(double, AbortingBackend.rlinfer_abort, caps, Capability.LORA, "double")
    # claimed (or optional outright) but not implemented: refused naming the hook
    for hook in (PausingBackend.rlinfer_pause, ProcessesBackend.rlinfer_engine_processes):
        with pytest.raises(UnsupportedCapability) as refused:
            optional_hook(double, hook, caps, None, "double")
        assert refused.value.capability == hook.__name__
    assert implemented(double, PausingBackend.rlinfer_resume) is None
    with pytest.raises(TypeError, match="required hook"):
        optional_hook(double, Backend.rlinfer_generate, caps, None, "double")


# --- the pool -------------------------------------------------------------------------------------


def test_the_pool_is_a_backend_with_every_operation_hook() -> None:
    """A pool is served as the facade over rlinfer_ray's PoolBackend: its hooks are the hookspecs'."""
    pool = import_pool_backend()
    problems = [
        f"PoolBackend.{name}{inspect.signature(getattr(pool, name, None) or (lambda: None))}"
        for name in _members_of_all(FullBackend)
        if not callable(getattr(pool, name, None))
        or list(inspect.signature(getattr(pool, name)).parameters)
        != list(inspect.signature(getattr(FullBackend, name)).parameters)
    ]
    assert problems == []
