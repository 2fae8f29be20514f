"""Request bodies of the SGLang dialect, under SGLang's own field names (``GenerateReqInput``,
``UpdateWeightFromDiskReqInput``... in ``sglang/srt/managers/io_struct.py``).

Unknown fields are refused, as in rlinfer's other bodies. A field SGLang accepts is not unknown:
those rlinfer serves are typed; those it does not are declared with their neutral value only
(``None``/``False``/``0``), so a client that sends the default passes and any other value is a 400
naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from rlinfer_server.schemas import Body


class SglSamplingParams(Body):
    """SGLang's ``sampling_params`` (``sglang/srt/sampling/sampling_params.py``) and its defaults."""

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: Literal[True] = True
    no_stop_trim: bool = False
    n: int = 1
    json_schema: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    stream_interval: int | None = None  # every engine delta is sent
    ebnf: str | None = None  # capabilities generate.structured and generate.grammar_ebnf
    stop_regex: str | list[str] | None = None  # capability generate.stop_regex
    # accepted at their neutral values only (each engine's structural tags differ; no beam search)
    structural_tag: None = None
    custom_params: None = None
    beam_width: Literal[0, 1] | None = None
    watermark: None = None


class SglGenerateBody(Body):
    """``POST /generate``: one prompt (``text`` or ``input_ids``) or a batch of them."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SglSamplingParams | list[SglSamplingParams] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    lora_path: str | None = None
    log_metrics: bool = True
    session_id: str | None = None  # a routing hint (consistent hashing in SGLang's router)
    data_parallel_rank: int | None = None  # a routing hint
    #: SGLang's order (higher first, its default); capability generate.priority
    priority: int | None = None
    #: ``meta_info.routed_experts`` (capability generate.routed_experts), rows from this position
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    #: ``meta_info.hidden_states`` (capability generate.hidden_states), as SGLang lays them out
    return_hidden_states: bool = False
    #: images as ``data:`` URLs (capability generate.multimodal): one prompt takes one URL or a
    #: list; a batch takes a list per prompt (None or [] for a prompt without images). The
    #: prompt holds the model's image token once per image (or the expanded run)
    image_data: str | list[str] | list[list[str] | None] | None = None
    # accepted at their neutral values only
    token_ids_logprob: None = None
    video_data: None = None
    audio_data: None = None
    input_embeds: None = None
    custom_logit_processor: None = None
    bootstrap_host: None = None
    bootstrap_port: None = None
    bootstrap_room: None = None
    modalities: None = None


class SglUpdateFromDiskBody(Body):
    """``POST /update_weights_from_disk``."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: Literal[False] = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True


class SglUpdateFromTensorBody(Body):
    """``POST /update_weights_from_tensor``: one base64 ``MultiprocessingSerializer`` payload per
    TP rank (slime's colocated update)."""

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Literal["target", "draft", "all"] = "all"
    torch_empty_cache: bool = False


class SglInitGroupBody(Body):
    """``POST /init_weights_update_group`` (AReaL sends ``master_port`` as a string)."""

    master_address: str
    master_port: int | str
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"
    pp_rank: int | None = None  # AReaL's; one pipeline stage per engine here


class SglUpdateFromDistributedBody(Body):
    """``POST /update_weights_from_distributed``: one broadcast per tensor from rank 0 follows."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: None = None  # "flattened_bucket" is not served (see docs/server.md)


class SglPauseBody(Body):
    """``POST /pause_generation``."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class SglEmptyBody(Body):
    """Bodies without fields (``/continue_generation``, ``/begin_weight_update``...)."""


class SglMemoryBody(Body):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``."""

    tags: list[str] | None = None


class SglAbortBody(Body):
    """``POST /abort_request``: one request by ``rid``, or all."""

    rid: str = ""
    abort_all: bool = False
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None


class SglWeightVersionBody(Body):
    """``POST /update_weight_version``."""

    new_version: str
    abort_all_requests: bool = True
