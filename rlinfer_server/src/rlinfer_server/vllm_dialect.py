"""``rlinfer serve --dialect vllm`` (in progress)."""

from __future__ import annotations

from fastapi import APIRouter

from rlinfer_server.dialects import Dialect

router = APIRouter()
DIALECT = Dialect("vllm", router)
