"""rlinfer errors -> HTTP statuses for EngineOutOfMemory (no engine): 400 when the request can
never fit the KV cache (as both engines answer an over-long prompt), 503 when it was turned away
under pressure (SGLang's "Retry later")."""

from __future__ import annotations

import pytest

from rlinfer_core.errors import EngineOutOfMemory
from rlinfer_server.dialect_common import error_status
from rlinfer_server.errors import status_of


@pytest.mark.parametrize(("transient", "status"), [(False, 400), (True, 503)])
def test_out_of_memory_status(transient: bool, status: int) -> None:
    exc = EngineOutOfMemory("no room", transient=transient)
    assert status_of(exc) == (status, "engine_out_of_memory", None)
    assert status_of(exc, control=True)[0] == status
    assert error_status(exc) == (status, "engine_out_of_memory")
