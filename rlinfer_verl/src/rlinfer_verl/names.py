"""Names shared by the replica (which starts the server actor) and the adapter (which finds it)."""

from __future__ import annotations


def server_actor_name(replica_rank: int, role: str = "", suffix: str = "") -> str:
    """The Ray actor name of replica ``replica_rank``'s server (``role``: "reward" / "teacher" /
    "" as verl names its own servers; ``suffix``: verl's ``name_suffix``)."""
    middle = f"{role}_" if role else ""
    tail = f"_{suffix}" if suffix else ""
    return f"rlinfer_server_{middle}{replica_rank}_0{tail}"


def model_path_of(model_config: object) -> str:
    """The model directory of verl's model config: ``HFModelConfig.local_path`` (a DictConfig is
    made one first, as verl's own servers do; it resolves and fetches the path)."""
    from omegaconf import DictConfig

    if isinstance(model_config, DictConfig):
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import HFModelConfig

        model_config = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
    for attr in ("local_path", "path"):
        value = getattr(model_config, attr, None)
        if value is None and hasattr(model_config, "get"):
            value = model_config.get(attr)
        if isinstance(value, str) and value:
            return value
    raise ValueError(f"verl's model config names no model path: {model_config!r}")
