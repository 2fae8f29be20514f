"""The rlinfer conformance kit against the vllm backend: the whole adoption is this file.

Run: `pytest tests/backends/test_vllm_conformance.py --rlinfer-backend vllm --rlinfer-report out/conformance-vllm.json`
"""

from rlinfer_conformance.suite import *  # noqa: F403
