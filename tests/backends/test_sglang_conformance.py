"""The rlinfer conformance kit against the sglang backend: the whole adoption is this file.

Run: `make test-sglang` (pytest ... --rlinfer-backend sglang --rlinfer-report out/conformance-sglang.json)
"""

from rlinfer_conformance.suite import *  # noqa: F403
