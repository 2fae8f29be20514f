"""Which key each route of ``rlinfer serve`` needs, per dialect: the routes state it (their
router's tag); this is the list the guard must end up with."""

from __future__ import annotations

import pytest

from rlinfer_server.app import create_app
from rlinfer_server.guard import Access, Guard, access
from rlinfer_server.settings import ServerSettings

VLLM_CONTROL = {
    "/pause",
    "/resume",
    "/abort_requests",
    "/sleep",
    "/wake_up",
    "/reset_prefix_cache",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/collective_rpc",
}
SGLANG_CONTROL = {
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/begin_weight_update",
    "/end_weight_update",
    "/pause_generation",
    "/continue_generation",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/flush_cache",
    "/abort_request",
    "/update_weight_version",
}


async def _no_engine() -> None:
    raise AssertionError("the routes are read without opening an engine")


@pytest.mark.parametrize(
    "dialect,control,open_",
    [
        ("openai", set(), {"/health"}),
        ("vllm", VLLM_CONTROL, {"/health"}),
        ("sglang", SGLANG_CONTROL, {"/health", "/health_generate"}),
    ],
)
def test_each_route_needs_the_key_its_router_states(dialect: str, control: set[str], open_: set[str]) -> None:
    app = create_app(_no_engine, ServerSettings(dialect=dialect))  # type: ignore[arg-type]
    guard = next(m for m in app.user_middleware if m.cls is Guard)
    routes = guard.kwargs["routes"]
    needs = {path: access(path, routes) for path in routes}
    assert {p for p, a in needs.items() if a is Access.CONTROL} == control | {
        p for p in routes if p.startswith("/control/")
    }
    assert {p for p, a in needs.items() if a is Access.OPEN} == open_
    assert "/v1/completions" in routes and needs["/v1/completions"] is Access.GENERATE
    assert access("/control/no_such_route", routes) is Access.CONTROL  # unknown, still behind the control key
    assert access("/no_such_route", routes) is Access.GENERATE
