"""``import rlinfer_core`` and ``rlinfer backends`` import neither torch nor any engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "vllm", "sglang", "transformers", "safetensors", "numpy")

SNIPPETS = {
    "import": "import rlinfer_core, rlinfer_core.types, rlinfer_core.weights, rlinfer_core.wire",
    "backends": (
        "import contextlib, io, rlinfer_core.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()) as buf:\n"
        "    code = rlinfer_core.cli.main(['backends', '--json'])\n"
        "assert code == 0 and 'backends' in json.loads(buf.getvalue())\n"
    ),
    "backends-table": (
        "import contextlib, io, rlinfer_core.cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert rlinfer_core.cli.main(['backends']) == 0\n"
    ),
}


@pytest.mark.parametrize("what", sorted(SNIPPETS))
def test_no_heavy_imports(what: str) -> None:
    code = (
        "import json, sys\n"
        f"{SNIPPETS[what]}\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r})\n"
        "print(json.dumps(heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_the_check_itself_can_fail() -> None:
    code = "import sys, rlinfer_core.transfer.buckets as b; b.to_dtype('float32'); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "True"
