"""What rlinfer's SGLang generate adds after SGLang's answer: turning 128 output dicts of 512
sampled tokens each (the GPU bench's batch, logprobs on, as both bench sides ask for them) into
Completions stamped with their tokens' weight versions. CPU only, no engine; the cost is set
against the wall time of one such batch on the H100 (1.7 s at 38 000 tok/s):

    .venvs/sglang/bin/python dev/bench/sglang_convert_bench.py
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

import attrs

from rlinfer_core.types import GenerateRequest, SamplingParams
from rlinfer_sglang import outputs
from rlinfer_sglang.versions import TokenVersions

REQUESTS, TOKENS, REPEATS = 128, 512, 5
H100_BATCH_S = REQUESTS * TOKENS / 38_000


def fake_outputs() -> list[dict[str, Any]]:
    rng = random.Random(0)
    made = []
    for _ in range(REQUESTS):
        ids = [rng.randrange(1000) for _ in range(TOKENS)]
        meta = {
            "output_token_logprobs": [(-rng.random(), t, None) for t in ids],
            "finish_reason": {"type": "length", "length": TOKENS},
        }
        made.append({"output_ids": ids, "meta_info": meta, "text": None})
    return made


def main() -> None:
    sampling = SamplingParams(temperature=1.0, max_tokens=TOKENS, min_tokens=TOKENS, ignore_eos=True)
    requests = [
        GenerateRequest(prompt_token_ids=[1] * 128, sampling=sampling, request_id=f"r{i}") for i in range(REQUESTS)
    ]
    outs = fake_outputs()
    versions = TokenVersions()
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        for k, (request, out) in enumerate(zip(requests, outs, strict=True)):
            c = outputs.completion(request, 0, request.prompt_token_ids or (), out, 1.0)
            attrs.evolve(c, token_versions=versions.of(f"rid{k}", len(c.token_ids)))
        samples.append(time.perf_counter() - t0)
    cost = statistics.median(samples)
    print(
        f"conversion of {REQUESTS} x {TOKENS} tokens: {cost * 1e3:.1f} ms median of {REPEATS} "
        f"(min {min(samples) * 1e3:.1f}, max {max(samples) * 1e3:.1f}); "
        f"{cost / H100_BATCH_S:.1%} of the batch's {H100_BATCH_S:.2f} s on the H100"
    )


if __name__ == "__main__":
    main()
