"""CPU test stand-in for ``sgl_kernel`` (SGLang's CUDA kernel package).

This is test infrastructure for running real SGLang on a CPU-only machine, installed only by
``dev/envs/post_sglang.sh`` into the CPU test environment. SGLang 0.5.23 imports the names below at module
level on its CPU path; none is called when serving a dense model without speculative decoding.
Each raises ``NotImplementedError`` if it is. No ``torch.ops.sgl_kernel`` operator is registered,
so SGLang's CPU-kernel (AMX) detection reports False and SGLang uses native PyTorch code.

A few modules look up ``torch.ops.sgl_kernel.<name>`` at import time on CPU (``OPERATOR_STUBS``): Qwen3.5's
model module, which SGLang's Qwen-VL multimodal processor (``qwen_vl.py``, the processor of Qwen2-VL and
Qwen2.5-VL too) imports, so without them no Qwen-VL model can be served. Those names are set on the
``torch.ops.sgl_kernel`` namespace as plain Python stubs (no operator registration: SGLang's
``hasattr(torch.ops.sgl_kernel, ...)`` feature checks see only these names) that raise
``NotImplementedError`` if called; Qwen2-VL / Qwen2.5-VL never call them.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
]

__version__ = "0.0.1+cpu.shim"


def _stub(name: str) -> Any:
    def fn(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available: this is the CPU test shim "
            "(dev/envs/cpu_support), which provides no kernels. Install the real sglang-kernel on GPU."
        )

    fn.__name__ = name
    fn.__qualname__ = name
    return fn


assign_draft_cache_locs_contiguous_cpu = _stub("assign_draft_cache_locs_contiguous_cpu")
assign_extend_cache_locs_cpu = _stub("assign_extend_cache_locs_cpu")
assign_req_to_token_pool_cpu = _stub("assign_req_to_token_pool_cpu")
build_tree_kernel_efficient_cpu = _stub("build_tree_kernel_efficient_cpu")
copy_all_layer_kv_cache_cpu = _stub("copy_all_layer_kv_cache_cpu")
fill_accept_out_cache_loc_cpu = _stub("fill_accept_out_cache_loc_cpu")
fill_bonus_tokens_cpu = _stub("fill_bonus_tokens_cpu")
rotate_input_ids_cpu = _stub("rotate_input_ids_cpu")
verify_tree_greedy_cpu = _stub("verify_tree_greedy_cpu")

#: torch.ops.sgl_kernel names looked up at import time by modules SGLang's Qwen-VL processor imports
#: (sglang/srt/models/qwen3_5.py); none is called by the models rlinfer serves on CPU
OPERATOR_STUBS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)


def _install_operator_stubs() -> None:
    import torch

    namespace = torch.ops.sgl_kernel
    for name in OPERATOR_STUBS:
        if not hasattr(namespace, name):  # a real operator (never in this shim's env) wins
            setattr(namespace, name, _stub(f"ops.{name}"))


_install_operator_stubs()
