"""``rlinfer demo``: a real GRPO loop through rlinfer.

A PyTorch/transformers policy on the trainer side, a real engine (vLLM or SGLang) behind the
rlinfer contract on the rollout side. Each step: generate G samples per prompt with logprobs,
score them with a verifiable reward, check trainer/engine logprob parity, take a GRPO step, sync
the new weights into the engine, and release/resume engine memory around the train phase where
the platform supports it.

Modules: :mod:`.task` (prompts + reward), :mod:`.trainer` (policy + GRPO math), :mod:`.loop`
(one run), :mod:`.report` (progress display, report.json, plots), :mod:`.console` (engine logs to
a file), :mod:`.cli` (the command), :mod:`.bench` (``rlinfer bench``), :mod:`.commands` (both
registered under the ``rlinfer.commands`` entry-point group).

This distribution (``rlinfer-demo``) is an example on top of the contract, not part of it.
Importing this package imports neither torch nor any engine.
"""
