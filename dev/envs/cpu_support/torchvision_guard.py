"""Guard torchvision's ``nms``/``qnms`` fake registrations (CPU test infrastructure).

The registry's torchvision wheel is a CUDA build. On CPU torch its ``_C`` extension does not load,
so ``torchvision/_meta_registrations.py`` raises at import (``operator torchvision::nms does not
exist``), which also breaks ``import transformers``. This script rewrites, in that one installed
file, ``@torch.library.register_fake("torchvision::nms")`` (and ``qnms``) into a decorator that
registers the fake kernel only if the operator exists. It is idempotent and checks its result by
importing torchvision. Run with the target environment's interpreter:
``.venvs/sglang/bin/python dev/envs/cpu_support/torchvision_guard.py``.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

MARKER = "# rlinfer-cpu-guard"
HELPER = f"""
{MARKER}: register fake kernels only for operators that exist (CUDA wheel on CPU torch).
def _rlinfer_register_fake_if_exists(op_name):
    namespace, _, name = op_name.partition("::")
    if hasattr(getattr(torch.ops, namespace), name):
        return torch.library.register_fake(op_name)
    return lambda fn: fn
"""
PATTERN = re.compile(r'@torch\.library\.register_fake\((["\'])torchvision::(nms|qnms)\1\)')


def main() -> int:
    """Patch the installed torchvision, then verify it imports; return a process exit code."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision_guard: torchvision is not installed; nothing to do")
        return 0
    target = Path(spec.origin).parent / "_meta_registrations.py"
    text = target.read_text()
    if MARKER not in text:
        new, count = PATTERN.subn(r'@_rlinfer_register_fake_if_exists("torchvision::\2")', text)
        if count == 0:
            print(f"torchvision_guard: no nms/qnms registration found in {target}; unchanged")
        else:
            anchor = new.index("\n", new.index("import torch")) + 1
            target.write_text(new[:anchor] + HELPER + new[anchor:])
            print(f"torchvision_guard: guarded {count} registration(s) in {target}")
    check = subprocess.run([sys.executable, "-c", "import torchvision, transformers"], check=False)
    return check.returncode


if __name__ == "__main__":
    raise SystemExit(main())
