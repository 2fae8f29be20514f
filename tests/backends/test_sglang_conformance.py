"""The rlinfer conformance kit against the sglang backend: the whole adoption is this file.

Run: `pytest tests/backends/test_sglang_conformance.py --rlinfer-backend sglang --rlinfer-report out/conformance-sglang.json`
"""

from rlinfer_conformance.suite import *  # noqa: F403
