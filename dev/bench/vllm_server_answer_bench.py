"""What the vLLM batch route's answer costs after the last token: building, JSON encoding and
decoding, and the client's conversion, for one batch of 128 requests x 512 sampled tokens (the GPU
bench's batch), in the compact shape the route writes now and in the per-token-dict shape of the
token endpoint that it wrote before (``engine_route.compact``). CPU only, no engine:

    .venvs/vllm/bin/python dev/bench/vllm_server_answer_bench.py
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from vllm.logprobs import Logprob

from rlinfer_core.types import GenerateRequest, SamplingParams
from rlinfer_vllm import token_endpoint as convert
from rlinfer_vllm.api_server import engine_route

REQUESTS, TOKENS, REPEATS = 128, 512, 3


class NoVersions:
    def take(self, engine_id: str, index: int, count: int) -> list[int]:
        return [0] * count


def outputs() -> list[Any]:
    rng = random.Random(0)
    made = []
    for _ in range(REQUESTS):
        tokens = [rng.randrange(1000) for _ in range(TOKENS)]
        rows = [{t: Logprob(logprob=-rng.random(), rank=1)} for t in tokens]
        choice = SimpleNamespace(index=0, token_ids=tokens, logprobs=rows, finish_reason="length", stop_reason=None)
        made.append(SimpleNamespace(outputs=[choice], prompt_logprobs=None))
    return made


def compact(final: Any) -> dict[str, Any]:
    return engine_route.answer("r", "e", final, NoVersions(), with_top=False)


def per_token_dicts(final: Any) -> dict[str, Any]:
    """The token endpoint's shape: a dict per token, with its top-logprob dicts."""
    answer = engine_route.answer("r", "e", final, NoVersions(), with_top=True)
    for c in answer["choices"]:
        rows = zip(c["token_ids"], c.pop("lp"), c.pop("top"), strict=True)
        c["logprobs"] = {
            "content": [
                {
                    "token_id": t,
                    "logprob": lp,
                    "top_logprobs": [{"token_id": x[0], "logprob": x[1], "rank": x[2]} for x in top],
                }
                for t, lp, top in rows
            ]
        }
    return answer


def timed(build: Callable[[Any], dict[str, Any]], finals: list[Any]) -> tuple[list[float], int]:
    request = GenerateRequest(
        prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=TOKENS, temperature=1.0), request_id="r"
    )
    t0 = time.perf_counter()
    answers = [build(f) for f in finals]
    t1 = time.perf_counter()
    lines = [json.dumps(a) for a in answers]
    t2 = time.perf_counter()
    back = [json.loads(line) for line in lines]
    t3 = time.perf_counter()
    for b in back:
        convert.completions(request, [1, 2], b, 0.1, 0)
    t4 = time.perf_counter()
    return [t1 - t0, t2 - t1, t3 - t2, t4 - t3], sum(map(len, lines))


def main() -> None:
    finals = outputs()
    for name, build in (("per-token dicts (before)", per_token_dicts), ("compact (now)", compact)):
        runs = [timed(build, finals) for _ in range(REPEATS)]
        build_s, encode_s, decode_s, convert_s = (statistics.median(r[0][i] for r in runs) for i in range(4))
        total = build_s + encode_s + decode_s + convert_s
        print(
            f"{name}: build {build_s:.3f} s, encode {encode_s:.3f} s, decode {decode_s:.3f} s, "
            f"convert {convert_s:.3f} s, total {total:.3f} s, {runs[0][1] / 1e6:.1f} MB"
        )


if __name__ == "__main__":
    main()
