"""Code that runs inside SGLang's scheduler process (each TP rank's), not in the caller's.

SGLang imports these by name there: the weight loader (:mod:`~rlinfer_sglang.scheduler.loader`,
named by ``--custom-weight-loader``), which requantizes FP8 weights
(:mod:`~rlinfer_sglang.scheduler.requantize`); rlinfer's logits processor
(:mod:`~rlinfer_sglang.scheduler.logits`, serialized into requests that need it); and the CPU fix
for SGLang's routed-experts buffer (:mod:`~rlinfer_sglang.scheduler.cpu_routes`, unpickled with the
scheduler's start arguments).
"""
