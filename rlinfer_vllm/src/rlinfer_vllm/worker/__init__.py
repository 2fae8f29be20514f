"""Code that runs inside vLLM's worker processes (one per tensor-parallel rank).

vLLM loads :class:`RLInferWorkerExtension` by its dotted path
(``worker_extension_cls="rlinfer_vllm.worker.RLInferWorkerExtension"``, set by
:mod:`rlinfer_vllm.config`; an attached server is started with it too) and runs its methods on
``collective_rpc``. Nothing here runs in the caller's process.
"""

from rlinfer_vllm.worker.extension import RLInferWorkerExtension

__all__ = ["RLInferWorkerExtension"]
