"""rlinfer backend over the real vLLM engine (``AsyncLLM``).

The entry point ``rlinfer.backends: vllm`` names :data:`rlinfer_vllm.plugin.backend`; the engine
is imported only when an engine is opened.
"""
