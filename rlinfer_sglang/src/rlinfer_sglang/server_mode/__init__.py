"""The SGLang backend's server flavour: rlinfer's hooks over SGLang's real HTTP server
(``python -m sglang.launch_server``, launched as a child on 127.0.0.1, or attached to by URL).
Selected by ``EngineConfig(mode="server")`` or ``EngineConfig(server_url=...)`` in
:func:`rlinfer_sglang.plugin.create`."""
