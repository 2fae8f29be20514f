"""The rlinfer conformance kit against the vllm backend: the whole adoption is this file.

Run: `make test-vllm` (pytest ... --rlinfer-backend vllm --rlinfer-report out/conformance-vllm.json)
"""

from rlinfer_conformance.suite import *  # noqa: F403
