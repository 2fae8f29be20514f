"""The slice of verl's GSM8K GRPO recipe (run_gsm8k_grpo_rlinfer.sh) that runs on CPU, on rlinfer.

verl's trainer needs GPUs for its FSDP actor; everything around it runs here with verl's own code:
the recipe's config composed by Hydra from verl's ``ppo_trainer.yaml`` (with the recipe's
overrides, ``rollout.name=rlinfer``, sized for a tiny model), the replica verl's registry returns
for ``rlinfer``, verl's load balancer, ``LLMServerClient`` and single-turn ``AgentLoopWorker``
generating ``n`` responses per GSM8K-style prompt, verl's GSM8K reward and GRPO advantage, and the
weight sync through verl's ``get_rollout_class("rlinfer")`` adapter from a named-tensor generator
(the actor's update itself is replaced by a second model's weights: the GPU part). Then it generates
again from the synced weights.

    .venvs/verl/bin/python examples/verl/gsm8k_cpu_slice.py [--backend vllm] [--out DIR]

Prints one JSON summary; a tiny random model answers no GSM8K question, so the rewards are 0 and
the point is the plumbing: shapes, logprobs, global steps and the verified update.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

#: the recipe's overrides (verl examples/grpo_trainer/run_qwen2-7b.sh) that mean something on CPU,
#: with rollout.name=rlinfer; sizes cut for a tiny model on 2 cores
RECIPE = [
    "algorithm.adv_estimator=grpo",
    "algorithm.use_kl_in_reward=False",
    "data.max_prompt_length=64",
    "data.max_response_length=16",
    "actor_rollout_ref.rollout.name=rlinfer",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.calculate_log_probs=True",
    "actor_rollout_ref.rollout.load_format=auto",
    "actor_rollout_ref.rollout.dtype=float32",
    "actor_rollout_ref.rollout.free_cache_engine=False",
    "actor_rollout_ref.rollout.enforce_eager=True",
    "actor_rollout_ref.rollout.max_model_len=512",
    "actor_rollout_ref.rollout.max_num_seqs=16",
    "actor_rollout_ref.rollout.agent.num_workers=1",
    "trainer.n_gpus_per_node=1",
]

#: GSM8K-style questions in verl's data layout (verl's examples/data_preprocess/gsm8k.py)
QUESTIONS = [
    (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "72",
    ),
    (
        "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "10",
    ),
]
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def compose(model: Path, backend: str) -> Any:
    """verl's trainer config with the recipe's overrides (what ``main_ppo`` would see)."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    overrides = [
        *RECIPE,
        f"actor_rollout_ref.model.path={model}",
        f"+actor_rollout_ref.rollout.custom.rlinfer.backend={backend}",
        "+actor_rollout_ref.rollout.custom.rlinfer.kv_cache_memory_bytes=67108864",
        "+actor_rollout_ref.rollout.custom.rlinfer.seed=0",
    ]
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=overrides)


def prompts_batch(n: int) -> Any:
    """verl's DataProto of the GSM8K prompts, each repeated ``n`` times (GRPO's group)."""
    import numpy as np
    from verl import DataProto

    rows = [
        {
            "raw_prompt": np.array([{"role": "user", "content": f"{q} {INSTRUCTION}"}], dtype=object),
            "data_source": "openai/gsm8k",
            "reward_model": {"style": "rule", "ground_truth": a},
            "uid": str(i),
        }
        for i, (q, a) in enumerate(QUESTIONS)
        for _ in range(n)
    ]
    non_tensor = {key: np.array([row[key] for row in rows], dtype=object) for key in rows[0]}
    non_tensor["agent_name"] = np.array(["single_turn_agent"] * len(rows), dtype=object)
    return DataProto.from_dict(non_tensors=non_tensor, meta_info={"global_steps": 0})


def grpo(output: Any, tokenizer: Any) -> dict[str, Any]:
    """verl's GSM8K reward on the decoded responses and its GRPO advantage per group."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage
    from verl.utils.reward_score import gsm8k

    responses, mask = output.batch["responses"], output.batch["response_mask"]
    rewards = torch.zeros_like(mask, dtype=torch.float32)
    scores = []
    for i in range(len(output)):
        length = int(mask[i].sum())
        text = tokenizer.decode(responses[i][:length], skip_special_tokens=True)
        truth = output.non_tensor_batch["reward_model"][i]["ground_truth"]
        scores.append(float(gsm8k.compute_score(text, truth)))
        rewards[i, max(length - 1, 0)] = scores[-1]
    advantages, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(output.non_tensor_batch["uid"]))
    return {"scores": scores, "advantages_finite": bool(torch.isfinite(advantages).all())}


async def run(backend: str, out: Path) -> dict[str, Any]:
    """The slice (see the module docstring); returns its summary."""
    import ray
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutMode, get_rollout_replica_class
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    from rlinfer_core.tiny_model import make_tiny_model

    model, update = make_tiny_model(out / "seed0", seed=0), make_tiny_model(out / "seed1", seed=1)
    config = compose(model, backend)
    rollout, model_config = config.actor_rollout_ref.rollout, config.actor_rollout_ref.model
    replica = get_rollout_replica_class(rollout.name)(replica_rank=0, config=rollout, model_config=model_config)
    replica.rollout_mode = RolloutMode.STANDALONE  # init_standalone would reserve GPUs for it
    await replica.launch_servers()
    try:
        balancer = ray.remote(GlobalRequestLoadBalancer).remote(servers={"0": replica.server_handle})
        worker = AgentLoopWorker(config, LLMServerClient(config, balancer))
        first = await worker.generate_sequences(prompts_batch(rollout.n))
        summary: dict[str, Any] = {
            "backend": backend,
            "responses_shape": list(first.batch["responses"].shape),
            "rollout_log_probs": "rollout_log_probs" in first.batch.keys(),  # noqa: SIM118  (TensorDict refuses `in`)
            "grpo": grpo(first, worker.tokenizer),
        }
        # the trainer's side after its (GPU) update: verl's adapter syncs the new weights
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        from rlinfer_conformance.oracle import Oracle

        oracle = Oracle()
        oracle.add("update", update)
        adapter = get_rollout_class(rollout.name, rollout.mode)(
            config=rollout, model_config=omega_conf_to_dataclass(model_config, HFModelConfig), device_mesh=None
        )
        await adapter.update_weights(iter(oracle.named_parameters("update")), global_steps=1)
        summary["weight_version"] = await replica.server_handle.weight_version.remote()
        second = await worker.generate_sequences(prompts_batch(rollout.n))
        summary["responses_changed"] = not bool((second.batch["responses"] == first.batch["responses"]).all())
        return summary
    finally:
        await replica.server_handle.shutdown.remote()


def main() -> None:
    """Command line: see the module docstring."""
    import tempfile

    import ray

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="vllm", choices=["vllm", "sglang"])
    parser.add_argument("--out", type=Path, default=None, help="folder for the tiny models (default: a temp dir)")
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(asyncio.run(run(args.backend, args.out or Path(tmp))), indent=2))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
