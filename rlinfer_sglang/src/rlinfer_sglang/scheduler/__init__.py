"""Code that runs inside SGLang's scheduler process (each TP rank's), not in the caller's.

SGLang imports these by name there: the weight loader (:mod:`~rlinfer_sglang.scheduler.loader`,
named by ``--custom-weight-loader``), which loads by batched copies where verified
(:mod:`~rlinfer_sglang.scheduler.fast_load`; on an online-FP8 engine
:mod:`~rlinfer_sglang.scheduler.fp8_load`, quantizing into the served codes) and otherwise requantizes
FP8 weights after ``load_weights`` (:mod:`~rlinfer_sglang.scheduler.requantize`); rlinfer's logits processor
(:mod:`~rlinfer_sglang.scheduler.logits`, serialized into requests that need it); and the CPU fix
for SGLang's routed-experts buffer (:mod:`~rlinfer_sglang.scheduler.cpu_routes`, unpickled with the
scheduler's start arguments).
"""
