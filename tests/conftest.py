"""Shared pytest setup for the whole tests/ tree.

Tests import helper modules that live next to them by bare name (``recording_double``,
``tensor_helpers``, ``mp_workers``, ``vllm_test_helpers``, ...). pytest's default import mode puts
each test folder on ``sys.path``; ``--import-mode=importlib`` does not, so the helper folders are
added here once, and both modes work.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HELPER_FOLDERS = (HERE / "core", HERE / "core" / "doubles", HERE / "backends" / "vllm", HERE / "backends" / "sglang")

for folder in HELPER_FOLDERS:
    if folder.is_dir() and str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
