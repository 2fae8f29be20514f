"""Keep the terminal for the demo's own display: the engine's logs go to a file.

Engines log from the main process (Python logging, warnings, progress bars) and from the child
processes they start, which inherit file descriptors 1 and 2. Redirecting those descriptors (not
just ``sys.stdout``) before the engine starts catches both; the rich console writes to a copy of
the original terminal descriptor.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console


@contextlib.contextmanager
def engine_logs_to(log_path: Path, verbose: bool = False) -> Iterator[Console]:
    """Send everything written to fds 1 and 2 to ``log_path`` (unless ``verbose``); yield a
    console on the real terminal."""
    from rich.console import Console

    if verbose:
        yield Console()
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = (os.dup(1), os.dup(2))
    terminal = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    try:
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                yield Console(file=terminal)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)
        terminal.close()
