"""The vLLM backend's server flavour: rlinfer's hooks over a real ``vllm serve`` process (launched
as a child on 127.0.0.1, or attached to by URL). Selected by ``EngineConfig(mode="server")`` or
``EngineConfig(server_url=...)`` in :func:`rlinfer_vllm.backend.create`."""
