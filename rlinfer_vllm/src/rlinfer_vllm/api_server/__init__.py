"""Code that runs inside vLLM's own API-server process (``vllm serve``), loaded by dotted path:
the ASGI middleware :class:`rlinfer_vllm.api_server.batch_route.BatchRoute` (``--middleware``),
which also serves :mod:`rlinfer_vllm.api_server.engine_route`'s routes."""
