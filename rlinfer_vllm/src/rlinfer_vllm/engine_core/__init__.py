"""Code that runs in vLLM's engine-core process (the scheduler's), loaded there as a vLLM general
plugin (entry point group ``vllm.general_plugins``): :mod:`rlinfer_vllm.engine_core.step_boundary`."""
