"""The vLLM dialect suite: the same tests against vLLM's own server (``vllm serve`` with
``VLLM_SERVER_DEV_MODE=1`` and ``--enable-scale-out``, CPU) and ``rlinfer serve --dialect vllm``
over the SGLang and the vLLM backend, with httpx as TRL's and SkyRL's clients use it, and with
TRL's own ``VLLMClient`` (TRL is installed in ``.venvs/vllm``).

Run from ``.venvs/vllm``; the rlinfer server over SGLang runs from ``.venvs/sglang``. vLLM's own
weight transfer does not run on CPU (``/init_weight_transfer_engine`` answers 500 "Cannot access
accelerator device"), so the weight-transfer lifecycle is checked on rlinfer's servers only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from dialect_servers import (
    MAX_MODEL_LEN,
    PROMPT,
    VENVS,
    DialectServer,
    Oracle,
    free_port,
    rlinfer_serve_command,
    selected,
    started,
)

SERVERS = selected(("vllm-reference", "rlinfer-sglang", "rlinfer-vllm", "rlinfer-sglang-pool", "rlinfer-vllm-pool"))
GREEDY = {"max_tokens": 8, "temperature": 0.0}


def _reference_command(model: Path, port: int) -> list[str]:
    return [
        str(VENVS / "vllm" / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--dtype",
        "float32",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--max-num-seqs",
        "16",
        "--seed",
        "0",
        "--enable-scale-out",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


@pytest.fixture(scope="session", params=SERVERS)
def server(
    request: pytest.FixtureRequest, tiny_models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DialectServer]:
    """One server of each kind for the session (one engine at a time)."""
    kind: str = request.param
    tmp = tmp_path_factory.mktemp(kind)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if kind == "vllm-reference":
        port = free_port()
        env["VLLM_SERVER_DEV_MODE"] = "1"
        with started(kind, _reference_command(tiny_models[0], port), env, tmp, None, f"http://127.0.0.1:{port}") as s:
            yield s
        return
    ready = tmp / "ready.json"
    command = rlinfer_serve_command(kind, tiny_models[0], "vllm", ready)
    with started(kind, command, env, tmp, ready, None) as served:
        yield served


@pytest.fixture(scope="session")
def oracle() -> Oracle:
    return Oracle()


def token_generate(client: httpx.Client, **sampling: Any) -> dict[str, Any]:
    r = client.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": sampling})
    assert r.status_code == 200, r.text
    return r.json()


def test_token_generate_matches_the_oracle(server: DialectServer, oracle: Oracle, tiny_models: Any) -> None:
    tokens, logprobs = oracle.greedy(tiny_models[0], PROMPT, 8)
    with server.client() as c:
        answer = token_generate(c, **GREEDY, logprobs=1)
    (choice,) = answer["choices"]
    assert choice["token_ids"] == tokens
    assert choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == tokens
    assert [e["logprob"] for e in content] == pytest.approx(logprobs, abs=2e-3)
    spans = choice["weight_versions"]
    assert spans[0]["start"] == 0 and spans[-1]["end"] == 8


def test_token_generate_n_and_stop_token(server: DialectServer, oracle: Oracle, tiny_models: Any) -> None:
    tokens = oracle.greedy(tiny_models[0], PROMPT, 8)[0]
    with server.client() as c:
        answer = token_generate(c, max_tokens=8, temperature=1.0, n=2)  # vLLM refuses n > 1 when greedy
        assert [ch["index"] for ch in answer["choices"]] == [0, 1]
        assert all(len(ch["token_ids"]) == 8 for ch in answer["choices"])
        stopped = token_generate(c, **GREEDY, stop_token_ids=[tokens[2]])
    (choice,) = stopped["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == tokens[2]
    assert choice["token_ids"][-1] == tokens[2] or choice["token_ids"] == tokens[:2]


def test_bad_sampling_is_400(server: DialectServer) -> None:
    with server.client() as c:
        r = c.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"temperature": -1.0}})
        assert r.status_code == 400


@pytest.mark.parametrize(
    "bad",
    [{"rank_offset": "one"}, {"world_size": None}, {"rank_offset": 0}, {"rank_offset": True}, {"colour": "red"}],
    ids=["rank_offset-word", "world_size-null", "rank_offset-0", "rank_offset-bool", "unknown-key"],
)
def test_bad_init_info_is_400(server: DialectServer, bad: dict[str, Any]) -> None:
    if server.is_reference:
        pytest.skip("vLLM's own weight transfer needs an accelerator (500 on CPU)")
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2, **bad}
    with server.client() as c:
        r = c.post("/init_weight_transfer_engine", json={"init_info": init_info})
        assert r.status_code == 400, r.text
        assert token_generate(c, **GREEDY)["choices"][0]["token_ids"]  # still serving


def test_pause_resume_is_paused(server: DialectServer, oracle: Oracle, tiny_models: Any) -> None:
    with server.client() as c:
        assert c.get("/is_paused").json() == {"is_paused": False}
        for mode in ("keep", "abort", "wait"):
            r = c.post(f"/pause?mode={mode}")
            assert r.status_code == 200 and r.json() == {"status": "paused"}
            assert c.get("/is_paused").json() == {"is_paused": True}
            r = c.post("/resume")
            assert r.status_code == 200 and r.json() == {"status": "resumed"}
            assert c.get("/is_paused").json() == {"is_paused": False}
        assert token_generate(c, **GREEDY)["choices"][0]["token_ids"] == oracle.greedy(tiny_models[0], PROMPT, 8)[0]


def test_pause_keep_holds_a_request_until_resume(server: DialectServer, oracle: Oracle, tiny_models: Any) -> None:
    import time

    with server.client() as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert c.post("/pause?mode=keep").status_code == 200
        future = pool.submit(token_generate, server.client(timeout=300), **GREEDY)
        time.sleep(2.0)
        assert not future.done()
        assert c.post("/resume").status_code == 200
        answer = future.result(timeout=120)
    assert answer["choices"][0]["token_ids"] == oracle.greedy(tiny_models[0], PROMPT, 8)[0]


def test_state_routes(server: DialectServer) -> None:
    with server.client() as c:
        assert c.get("/get_world_size").json() == {"world_size": 1}
        assert c.get("/get_world_size?include_dp=false").json() == {"world_size": 1}
        assert isinstance(c.get("/weight_info").json()["weight_version"], str)
        assert c.get("/is_sleeping").json() == {"is_sleeping": False}
        assert "vllm_config" in c.get("/server_info").json()
        assert c.post("/reset_prefix_cache").status_code == 200
        r = c.post("/abort_requests", json={})
        assert r.status_code == 200 and r.json()["status"] == "aborted"
        r = c.post("/abort_requests", json={"request_ids": ["no-such-request"]})
        assert r.status_code == 200 and r.json() == {"status": "aborted", "aborted": 1}


def test_update_weight_version_to_the_current_label(server: DialectServer) -> None:
    with server.client() as c:
        label = c.get("/weight_info").json()["weight_version"]
        r = c.post("/update_weight_version", json={"new_version": label})
        assert r.status_code == 200 and r.json() == {"success": True, "new_version": label}


def test_control_routes_need_the_key(server: DialectServer) -> None:
    if server.is_reference:
        pytest.skip("vLLM's dev mode opens its RL routes without a key")
    for path in ("/pause", "/resume", "/reset_prefix_cache", "/start_weight_update"):
        assert httpx.post(server.url + path, timeout=30).status_code == 401


# ---------------------------------------------------------------- TRL's own client


@pytest.fixture
def trl_client(server: DialectServer) -> Any:
    """TRL's ``VLLMClient`` on the server; it sends no key, so the session carries the control key
    (vLLM's dev mode ignores it; ``rlinfer serve --open-control`` would need none)."""
    from trl.generation.vllm_client import VLLMClient

    client = VLLMClient(base_url=server.url)
    client.session.headers.update(server.headers)
    return client


def test_trl_generate_matches_the_oracle(trl_client: Any, oracle: Oracle, tiny_models: Any) -> None:
    """``VLLMClient.generate`` as GRPOTrainer calls it (token-id prompts, ``logprobs=0``, TRL's
    ``top_k=0``): greedy tokens and their logprobs are the oracle's."""
    tokens, logprobs = oracle.greedy(tiny_models[0], PROMPT, 8)
    out = trl_client.generate([PROMPT, PROMPT], temperature=0.0, max_tokens=8, logprobs=0)
    assert out["prompt_ids"] == [PROMPT, PROMPT]
    assert out["completion_ids"] == [tokens, tokens]
    for per_token, ids in zip(out["logprobs"], out["logprob_token_ids"], strict=True):
        assert [ids_at[0] for ids_at in ids] == tokens
        assert [lp[0] for lp in per_token] == pytest.approx(logprobs, abs=2e-3)


def test_trl_generate_text_prompts_n_and_top_logprobs(trl_client: Any) -> None:
    out = trl_client.generate(["hello world", "Question:"], n=2, temperature=1.0, max_tokens=5, logprobs=2)
    assert len(out["prompt_ids"]) == 2 and out["prompt_ids"][0] != out["prompt_ids"][1]
    assert len(out["completion_ids"]) == 4 and all(len(ids) == 5 for ids in out["completion_ids"])
    for ids, per_token, alternatives in zip(
        out["completion_ids"], out["logprobs"], out["logprob_token_ids"], strict=True
    ):
        for token, lps, alts in zip(ids, per_token, alternatives, strict=True):
            assert token in alts and 2 <= len(alts) <= 3  # the sampled token and the top 2
            assert lps == sorted(lps, reverse=True)


def test_trl_chat_continues_the_rendered_prompt(trl_client: Any) -> None:
    """``VLLMClient.chat``: the prompt ids are the chat template's rendering, and greedy decoding
    from them through ``generate`` gives the same completion."""
    chat = trl_client.chat([[{"role": "user", "content": "hi there"}]], temperature=0.0, max_tokens=6)
    (prompt,) = chat["prompt_ids"]
    assert len(prompt) > 2
    again = trl_client.generate([prompt], temperature=0.0, max_tokens=6)
    assert chat["completion_ids"] == again["completion_ids"]


def test_trl_sequence_logprobs_match_the_oracle(trl_client: Any, oracle: Oracle, tiny_models: Any) -> None:
    """``VLLMClient.get_sequence_logprobs`` (teacher scoring for distillation, from the prompt
    logprobs with their top alternatives): every completion position's top k and the actual
    token's logprob are the oracle's."""
    tokens = oracle.greedy(tiny_models[0], PROMPT, 4)[0]
    sequence, k = PROMPT + [(t + 7) % 64 for t in tokens], 3  # a completion the model would not pick
    out = trl_client.get_sequence_logprobs([sequence], [len(PROMPT)], top_logprobs=k)
    rows = oracle.log_softmax(tiny_models[0], sequence)
    for i, position in enumerate(range(len(PROMPT), len(sequence))):
        want = rows[position - 1]
        values, ids = want.topk(k)
        assert out["logprobs"][0][i] == pytest.approx(values.tolist(), abs=2e-3)
        assert out["logprob_token_ids"][0][i] == ids.tolist()
        assert out["actual_token_ids"][0][i] == [sequence[position]]
        assert out["actual_logprobs"][0][i] == pytest.approx([float(want[sequence[position]])], abs=2e-3)


def test_trl_control_calls(trl_client: Any) -> None:
    """The control calls TRL's trainers make: world size, prefix-cache reset, and the server info
    fields they read (``model_config.logprobs_mode``, ``weight_transfer_config``)."""
    assert trl_client.get_world_size() == 1
    trl_client.reset_prefix_cache()
    info = trl_client.get_server_info()
    assert info["model_config"]["logprobs_mode"] in {"raw_logprobs", "processed_logprobs"}
    assert info["model_config"]["max_model_len"] == MAX_MODEL_LEN
    assert "weight_transfer_config" in info


def _tensors(model_dir: Path) -> list[tuple[str, Any]]:
    from safetensors.torch import load_file

    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def test_weight_transfer_lifecycle(server: DialectServer, oracle: Oracle, tiny_models: tuple[Path, Path]) -> None:
    """TRL's sequence (pause keep -> init -> start -> update (two calls) -> finish -> resume) over
    a gloo group; the new weights serve after finish with the version given, and calls out of
    order are 409."""
    if server.is_reference:
        pytest.skip("vLLM's own weight transfer needs an accelerator (500 on CPU)")
    from rlinfer_core.transfer.broadcast import WeightBroadcaster
    from rlinfer_core.weights import BroadcastGroup

    port = free_port()
    group = BroadcastGroup("127.0.0.1", port, world_size=2, backend="gloo", group_name="weight_update_group")
    tensors = _tensors(tiny_models[1])
    halves = [tensors[: len(tensors) // 2], tensors[len(tensors) // 2 :]]
    with server.client(timeout=300) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert c.post("/update_weights", json={"update_info": {}}).status_code == 409
        assert c.post("/finish_weight_update", json={}).status_code == 409
        init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
        init = pool.submit(c.post, "/init_weight_transfer_engine", json={"init_info": init_info})
        sender = WeightBroadcaster(group)
        try:
            assert init.result(timeout=180).status_code == 200
            version = int(c.get("/weight_info").json()["weight_version"]) + 1
            assert c.post("/pause?mode=keep").status_code == 200
            assert c.post("/start_weight_update", json={"is_checkpoint_format": True}).status_code == 200
            assert c.post("/start_weight_update", json={}).status_code == 409
            for half in halves:
                info = {
                    "names": [n for n, _ in half],
                    "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in half],
                    "shapes": [list(t.shape) for _, t in half],
                }
                update = pool.submit(c.post, "/update_weights", json={"update_info": info})
                sender.send(half)
                assert update.result(timeout=180).status_code == 200
            r = c.post("/finish_weight_update", json={"weight_version": str(version)})
            assert r.status_code == 200, r.text
            assert c.post("/resume").status_code == 200
        finally:
            with contextlib.suppress(Exception):
                sender.close()
        assert c.get("/weight_info").json() == {"weight_version": str(version)}
        answer = token_generate(c, **GREEDY)
        assert answer["choices"][0]["token_ids"] == oracle.greedy(tiny_models[1], PROMPT, 8)[0]
        assert answer["choices"][0]["weight_versions"] == [{"version": str(version), "start": 0, "end": 8}]


PACKED_BUFFER_BYTES = 64 << 10


def _send_packed(sender: Any, tensors: list[tuple[str, Any]], buffer_bytes: int, chunks: int | None = None) -> int:
    """Trainer side as vLLM runs it (``packed_tensor.pack_tensors`` cuts the buffers), over gloo;
    stops after ``chunks`` buffers when given. Returns the number of buffers sent."""
    import warnings

    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    remaining, sent = iter(tensors), 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM warns of a tensor larger than the buffer
        while (chunks is None or sent < chunks) and (chunk := pack_tensors(remaining, lambda i: i[1], buffer_bytes)):
            sender.send([("packed", chunk.packed_tensor)])
            sent += 1
    return sent


def _update_info(tensors: list[tuple[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "names": [n for n, _ in tensors],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
        **extra,
    }


@contextlib.contextmanager
def _joined(c: httpx.Client, pool: concurrent.futures.ThreadPoolExecutor, **packing: Any) -> Iterator[Any]:
    from rlinfer_core.transfer.broadcast import WeightBroadcaster
    from rlinfer_core.weights import BroadcastGroup

    port = free_port()
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, **packing}
    init = pool.submit(c.post, "/init_weight_transfer_engine", json={"init_info": init_info})
    sender = WeightBroadcaster(BroadcastGroup("127.0.0.1", port, world_size=2, group_name="weight_update_group"))
    try:
        assert init.result(timeout=180).status_code == 200
        yield sender
    finally:
        with contextlib.suppress(Exception):
            sender.close()


def test_weight_transfer_packed_as_vllm_cuts_it(
    server: DialectServer, oracle: Oracle, tiny_models: tuple[Path, Path]
) -> None:
    """Packed buffers cut by vLLM's own packer: packing named once in ``init_info`` (vLLM >= 0.28)
    and once per call in ``update_info`` (vLLM 0.26, TRL over it); each model's weights in turn
    serve at oracle parity after finish, so every byte landed where the names say."""
    if server.is_reference:
        pytest.skip("vLLM's own weight transfer needs an accelerator (500 on CPU)")
    from rlinfer_core.transfer.vllm_wire import packed_chunks
    from rlinfer_core.weights import specs_of

    with server.client(timeout=300) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        for model, where in ((tiny_models[1], "init_info"), (tiny_models[0], "update_info")):
            tensors = _tensors(model)
            packing = {"packed": True, "packed_buffer_size_bytes": PACKED_BUFFER_BYTES}
            chunks = packed_chunks(specs_of(tensors), PACKED_BUFFER_BYTES)
            assert len(chunks) > 2 and any(len(chunk) > 1 for chunk in chunks)  # the premise: real packing
            with _joined(c, pool, **(packing if where == "init_info" else {})) as sender:
                version = int(c.get("/weight_info").json()["weight_version"]) + 1
                assert c.post("/start_weight_update", json={}).status_code == 200
                info = _update_info(tensors, **(packing if where == "update_info" else {}))
                update = pool.submit(c.post, "/update_weights", json={"update_info": info})
                assert _send_packed(sender, tensors, PACKED_BUFFER_BYTES) == len(chunks)
                assert update.result(timeout=180).status_code == 200
                r = c.post("/finish_weight_update", json={"weight_version": str(version)})
                assert r.status_code == 200, r.text
            answer = token_generate(c, **GREEDY)
            assert answer["choices"][0]["token_ids"] == oracle.greedy(model, PROMPT, 8)[0], where
            assert c.get("/weight_info").json() == {"weight_version": str(version)}


def test_trainer_dying_mid_transfer_leaves_the_old_weights(
    server: DialectServer, oracle: Oracle, tiny_models: tuple[Path, Path]
) -> None:
    """The trainer leaves after one of several packed buffers: ``/update_weights`` fails with an
    error (not a hang), the update is dropped (finish is 409) and the old weights keep serving."""
    if server.is_reference:
        pytest.skip("vLLM's own weight transfer needs an accelerator (500 on CPU)")
    with server.client(timeout=300) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        before = token_generate(c, **GREEDY)["choices"][0]["token_ids"]
        version = c.get("/weight_info").json()
        other = next(m for m in tiny_models if oracle.greedy(m, PROMPT, 8)[0] != before)
        tensors = _tensors(other)
        packing = {"packed": True, "packed_buffer_size_bytes": PACKED_BUFFER_BYTES}
        with _joined(c, pool, timeout_s=10, **packing) as sender:
            assert c.post("/start_weight_update", json={}).status_code == 200
            update = pool.submit(c.post, "/update_weights", json={"update_info": _update_info(tensors)})
            assert _send_packed(sender, tensors, PACKED_BUFFER_BYTES, chunks=1) == 1
            sender.close()
            failed = update.result(timeout=60)
        assert failed.status_code in (400, 504), failed.text
        assert c.post("/finish_weight_update", json={}).status_code == 409
        assert c.get("/weight_info").json() == version
        assert token_generate(c, **GREEDY)["choices"][0]["token_ids"] == before


def test_skyrl_collective_rpc_weight_sync(
    server: DialectServer, oracle: Oracle, tiny_models: tuple[Path, Path]
) -> None:
    """SkyRL's sequence through ``/collective_rpc`` (its worker-extension methods): start,
    ``update_weights_nccl`` while the trainer broadcasts, finish; the new weights serve. An
    unknown method is refused with the methods served."""
    if server.is_reference:
        pytest.skip("vLLM's own workers have no SkyRL extension loaded, and its transfer needs an accelerator")
    with server.client(timeout=300) as c, concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = c.post("/collective_rpc", json={"method": "load_format_magic"})
        assert refused.status_code == 501 and "skyrl_start_weight_update" in refused.text
        before = token_generate(c, **GREEDY)["choices"][0]["token_ids"]
        model = next(m for m in tiny_models if oracle.greedy(m, PROMPT, 8)[0] != before)
        tensors = _tensors(model)
        with _joined(c, pool) as sender:
            rpc = {"method": "skyrl_start_weight_update", "kwargs": {"is_checkpoint_format": True}}
            assert c.post("/collective_rpc", json=rpc).json() == {"results": [None]}
            rpc = {"method": "update_weights_nccl", "kwargs": {"update_info": _update_info(tensors)}, "timeout": 120}
            update = pool.submit(c.post, "/collective_rpc", json=rpc)
            sender.send(tensors)
            assert update.result(timeout=180).status_code == 200
            done = c.post("/collective_rpc", json={"method": "skyrl_finish_weight_update"})
            assert done.status_code == 200, done.text
        assert token_generate(c, **GREEDY)["choices"][0]["token_ids"] == oracle.greedy(model, PROMPT, 8)[0]
