"""rlinfer-server: ``rlinfer serve`` puts any rlinfer engine behind HTTP.

OpenAI-compatible ``/v1/completions`` and ``/v1/chat/completions`` (with token ids, per-token
logprobs and weight versions), ``/v1/models``, ``/health``, Prometheus ``/metrics``, and control
endpoints under ``/control/`` behind a bearer token. Build an app with
:func:`rlinfer_server.app.create_app`; the command lives in :mod:`rlinfer_server.cli`.
"""

__version__ = "0.1.0"
