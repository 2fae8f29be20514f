"""ON THE DEVICE (2 GPUs): TRL's own weight sync into a vLLM-dialect server, checked by an oracle.

The server runs on GPU 0 — ``rlinfer serve --dialect vllm`` over the vLLM or the SGLang backend,
or, as the reference, vLLM's own server (``VLLM_SERVER_DEV_MODE=1``, ``--weight-transfer-config
'{"backend": "nccl"}'``). The trainer (this process, GPU 1) is TRL's ``VLLMClient`` unchanged:
``init_communicator`` (vLLM's StatelessProcessGroup + NCCL), then ``update_model_params`` inside
``weight_update()`` (packed NCCL broadcasts of every parameter). It sends the model with every
parameter perturbed, then the original again; after each update, greedy generation through
``VLLMClient.generate`` must be the HF oracle's greedy choice on the weights just sent, with its
logprobs (and the perturbed answer must differ from the original one: the premise that the
update is visible).

    source dev/gpu/env.sh vllm   # the trainer side needs vLLM (TRL imports its NCCL engine) and TRL
    CUDA_VISIBLE_DEVICES=1 python3 dev/gpu/trl_weight_sync.py --server rlinfer-vllm \
        --model /tmp/rlinfer_model --out $OUT/trl-sync-rlinfer-vllm.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 15, 27, 99, 123, 7, 64, 2000], [5, 6, 7, 8, 9, 10]]
MAX_TOKENS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(kind: str, model: str, port: int, dtype: str) -> str:
    """A bash command line starting the server of ``kind`` in its engine's environment."""
    common = f"--model {model} --dtype {dtype} --port {port}"
    if kind == "vllm-reference":
        config = json.dumps({"backend": "nccl"})
        return (
            f"source {REPO}/dev/gpu/env.sh vllm && VLLM_SERVER_DEV_MODE=1 exec python3 -m "
            f"vllm.entrypoints.openai.api_server {common} --host 127.0.0.1 --gpu-memory-utilization 0.4 "
            f"--max-model-len 2048 --enforce-eager --weight-transfer-config '{config}'"
        )
    backend = kind.removeprefix("rlinfer-")
    engine_args = "--engine-arg attention_backend=triton" if backend == "sglang" else ""
    return (
        f"source {REPO}/dev/gpu/env.sh {backend} && exec python3 -m rlinfer_core.cli serve --backend {backend} "
        f"{common} --dialect vllm --open-control --log-level warning --set gpu_memory_utilization=0.4 "
        f"--set max_model_len=2048 --set enforce_eager=true --set startup_timeout_s=400 {engine_args}"
    )


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise TimeoutError("the server did not become healthy")


def oracle_check(model: Any, served: list[tuple[list[int], list[float]]], tol: float) -> dict[str, Any]:
    """The HF model's view of what the engine served: its logprob of every served token (max
    |delta| against the engine's, within ``tol``), and whether each served token is the model's
    greedy choice (within ``tol`` of the best logprob: kernels differ in the last bits)."""
    import torch

    worst, greedy = 0.0, True
    for prompt, (tokens, logprobs) in zip(PROMPTS, served, strict=True):
        ids = torch.tensor([prompt + tokens], device=model.device)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        table = torch.log_softmax(logits, dim=-1)
        chosen = table[torch.arange(len(tokens)), torch.tensor(tokens, device=table.device)]
        worst = max(worst, float((chosen.cpu() - torch.tensor(logprobs)).abs().max()))
        greedy = greedy and bool((chosen >= table.max(dim=-1).values - tol).all())
    return {"max_abs_logprob_delta": worst, "greedy": greedy, "matches": greedy and worst < tol}


def engine_greedy(client: Any) -> list[tuple[list[int], list[float]]]:
    answer = client.generate(PROMPTS, temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    return [
        (list(ids), [float(per_token[0]) for per_token in lps])
        for ids, lps in zip(answer["completion_ids"], answer["logprobs"], strict=True)
    ]


def timed_update(client: Any, model: Any) -> float:
    start = time.perf_counter()
    with client.weight_update():
        client.update_model_params(model)
    return time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True, choices=["rlinfer-vllm", "rlinfer-sglang", "vllm-reference"])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tol", type=float, default=1e-2, help="logprob tolerance against the HF oracle")
    p.add_argument("--noise", type=float, default=0.05, help="std of the noise added to every parameter")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from trl.generation.vllm_client import VLLMClient

    port = free_port()
    log = Path(args.out).with_suffix(".server.log")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"}
    command = server_command(args.server, args.model, port, args.dtype)
    result: dict[str, Any] = {
        "server": args.server,
        "command": command,
        "dtype": args.dtype,
        "tol": args.tol,
        "noise": args.noise,
    }
    with log.open("wb") as sink:
        proc = subprocess.Popen(["bash", "-c", command], env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        started = time.monotonic()
        wait_ready(f"http://127.0.0.1:{port}", proc, 420)
        result["server_start_s"] = round(time.monotonic() - started, 1)
        dtype = getattr(torch, args.dtype)
        model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype).to("cuda").eval()
        result["trainer_gpu"] = torch.cuda.get_device_name()
        result["bytes"] = sum(t.numel() * t.element_size() for t in model.parameters())
        client = VLLMClient(base_url=f"http://127.0.0.1:{port}", group_port=free_port(), connection_timeout=60)
        client.init_communicator(device=0)
        original = {name: t.detach().clone() for name, t in model.state_dict().items()}
        before = engine_greedy(client)
        result["original_oracle"] = oracle_check(model, before, args.tol)
        generator = torch.Generator(device="cuda").manual_seed(1)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator, device="cuda", dtype=param.dtype) * args.noise)
        rounds = []
        for label in ("perturbed", "original"):
            if label == "original":
                model.load_state_dict(original)
            seconds = timed_update(client, model)
            served = engine_greedy(client)
            rounds.append(
                {
                    "weights": label,
                    "update_s": round(seconds, 3),
                    "gb_per_s": round(result["bytes"] / seconds / 1e9, 2),
                    "oracle": oracle_check(model, served, args.tol),
                    "served": [tokens for tokens, _ in served],
                }
            )
        result["rounds"] = rounds
        result["perturbed_differs"] = rounds[0]["served"] != [tokens for tokens, _ in before]
        matched = all(r["oracle"]["matches"] for r in rounds)
        result["passed"] = bool(result["original_oracle"]["matches"] and result["perturbed_differs"] and matched)
    except Exception as exc:  # the result file says what failed
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["passed"] = False
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    for r in result.get("rounds", []):
        print({k: v for k, v in r.items() if k != "served"})
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
