"""Weight loading inside vLLM's worker processes (a vLLM ``worker_extension_cls``).

vLLM mixes this class into its Worker; the backend calls its ``rlinfer_*`` methods through
``AsyncLLM.collective_rpc``, whose arguments travel by msgpack (bytes, str, lists), so tensors
arrive as shared-memory / CUDA-IPC handles (:mod:`rlinfer_core.transfer.ipc`), as a directory
path, or over the broadcast group.

Two ways of loading, chosen once per worker (:meth:`RLInferWorkerExtension.rlinfer_init`):

*In place* (CUDA, unquantized, no MLA attention, KV cache in the model's dtype): the model's own
``load_weights`` copies each tensor into its parameter slice (a ``q_proj`` tensor into its rows of
``qkv_proj``), so partial updates need nothing else and the copies stay on the GPU. This is what RL trainers on vLLM do;
rlinfer adds the checks. Nothing is written before every name, shape and dtype was checked (the
facade also checked finiteness); an error inside vLLM after that (a CUDA fault) may leave a
partial update and is reported as such. Where ``load_weights`` is nothing but copies into
parameter slices (verified architectures, no TP/PP/LoRA), an update whose every tensor has such a
slice is copied with one batched copy instead (:mod:`rlinfer_vllm.worker.fast_load`;
``RLINFER_VLLM_FAST_LOAD=0`` turns that off).

*Reload* (everything else: CPU, quantized models, MLA, expert kernels with a layout of their
own): vLLM's layer-wise in-place reload (``Worker.reload_weights``) re-runs ``load_weights`` and
the kernel processing (packing, quantization, MLA's derived matrices). That reload processes
whole layers: a layer whose fused parameters (e.g. ``qkv_proj`` from q/k/v) are only partly given
would be rebuilt from uninitialised memory, and vLLM's packed CPU weights cannot be read back. So the extension keeps a
host copy of the checkpoint (HF names; checkpoint dtypes under ``dtype="auto"``, else the served
dtype) - the *shadow* - and:

- a full update is loaded as given; a partial one is merged into the shadow first;
- the shadow is committed only after the engine loaded the update;
- names, shapes and dtypes are checked against the shadow before vLLM is touched;
- if loading still fails inside vLLM, its layer-wise reload state is unwound and the shadow (the
  old weights) is loaded back before the error is raised.

Its cost is one host-memory copy of the weights per worker, and a device-to-host copy of every
update. On an online-FP8 engine (vLLM 0.26, CUDA) an update giving whole layers is quantized by the
worker itself instead, without the reload or the shadow copy (:mod:`rlinfer_vllm.worker.fp8_load`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from rlinfer_vllm.worker.staging import StagedWeightsWorker

if TYPE_CHECKING:
    import torch

    from rlinfer_core.transfer.fast_load import FastLoader
    from rlinfer_vllm.worker.fp8_load import Fp8FastLoader

Pair = tuple[str, "torch.Tensor"]


class RLInferWorkerExtension(StagedWeightsWorker):
    """Mixed into vLLM's Worker; every public name starts with ``rlinfer_`` (no clashes). Staged
    updates: :class:`~rlinfer_vllm.worker.staging.StagedWeightsWorker`."""

    # attributes of vLLM's Worker that this mixin uses
    vllm_config: Any
    model_runner: Any
    device: Any
    rank: int

    _rlinfer_specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]
    _rlinfer_shadow: dict[str, torch.Tensor] | None  # reload mode only
    _rlinfer_shadow_dir: str | None
    _rlinfer_group: Any
    _rlinfer_tied: list[Any]  # modules whose kernel processing must follow a tied tensor
    _rlinfer_fast: FastLoader | None  # in-place mode on an engine where fast loads can apply
    _rlinfer_fp8: Fp8FastLoader | None  # reload mode on an online-FP8 engine where fast loads can apply

    # --- setup --------------------------------------------------------------------------------

    def rlinfer_init(self, checkpoint_dtypes: bool) -> list[tuple[str, str, list[int]]]:
        """Choose the loading mode, read the checkpoint's specs (and, to reload, the shadow);
        return (name, dtype, shape) of each tensor.

        ``checkpoint_dtypes``: keep each tensor's checkpoint dtype (rlinfer's ``dtype="auto"``:
        what a trainer holds and a checkpoint directory contains; vLLM casts on load) instead of
        the served dtype.
        """
        self._rlinfer_specs = {}
        self._rlinfer_shadow = None if self.rlinfer_loads_in_place() else {}
        import torch

        dummy = self.vllm_config.load_config.load_format == "dummy"
        read = self._rlinfer_checkpoint_layout if dummy else self._rlinfer_read_checkpoint
        for name, tensor, dtype in read(checkpoint_dtypes):
            self._rlinfer_specs[name] = (dtype, tuple(tensor.shape))
            if self._rlinfer_shadow is None:  # only the reload mode keeps the weights
                continue
            # a dummy start's shadow holds no policy: the first update must be full (the facade checks)
            # pinned on CUDA: each update's copy into the shadow runs asynchronously, one wait
            shadow = torch.empty(tensor.shape, dtype=dtype, pin_memory=self._rlinfer_on_cuda())
            if dummy:
                shadow.zero_()
            else:
                shadow.copy_(tensor)
            self._rlinfer_shadow[name] = shadow
        self._rlinfer_shadow_dir = None
        self._rlinfer_group = None
        from rlinfer_vllm.worker.fp8_load import loader_for as fp8_loader_for
        from rlinfer_vllm.worker.reload_log import quiet_buffer_only_layers
        from rlinfer_vllm.worker.served import tied_modules

        self._rlinfer_tied = tied_modules(self.model_runner.get_model())
        self._rlinfer_fast = self._rlinfer_fast_loader() if self._rlinfer_shadow is None else None
        self._rlinfer_fp8 = None if self._rlinfer_shadow is None else fp8_loader_for(self)
        quiet_buffer_only_layers(self.model_runner.get_model())  # "RotaryEmbedding: Failed to load weights"
        specs = self._rlinfer_specs.items()
        return [(name, str(dtype).removeprefix("torch."), list(shape)) for name, (dtype, shape) in specs]

    def rlinfer_loads_in_place(self) -> bool:
        """Whether ``load_weights`` alone puts an update in place (see the module docstring)."""
        config = self.vllm_config
        if config.device_config.device_type != "cuda" or config.model_config.quantization is not None:
            return False
        if config.cache_config.cache_dtype != "auto":  # fp8 KV cache: scales are processed
            return False
        from vllm.model_executor.layers.attention import MLAAttention

        from rlinfer_vllm.worker.experts import in_place_loadable

        model = self.model_runner.get_model()
        return in_place_loadable(model) and not any(isinstance(m, MLAAttention) for m in model.modules())

    def _rlinfer_fast_loader(self) -> FastLoader | None:
        """The batched loader for this in-place engine, or None where it can never apply."""
        import logging

        from rlinfer_vllm.worker.fast_load import fast_loader, ineligible_reason

        why_not = ineligible_reason(self.vllm_config, self.model_runner.get_model())
        if why_not is not None:
            logging.getLogger("rlinfer_vllm.worker").info("fast weight loading off: %s", why_not)
            return None
        served = self.vllm_config.model_config.dtype
        return fast_loader(self.model_runner.get_model, self._rlinfer_specs, served)

    def rlinfer_fast_load_state(self) -> dict[str, Any]:
        """Whether updates can be loaded fast here and why not (``reason``), and how many of the
        checkpoint's tensors have a parameter slice to be copied into (``mapped`` of ``total``)."""
        from rlinfer_vllm.worker.fast_load import ineligible_reason, parameter_views

        model = self.model_runner.get_model()
        reason = "reload mode (see rlinfer_loads_in_place)" if self._rlinfer_shadow is not None else None
        reason = reason or ineligible_reason(self.vllm_config, model)
        views = parameter_views(model, self._rlinfer_specs, self.vllm_config.model_config.dtype)
        return {
            "active": getattr(self, "_rlinfer_fast", None) is not None,
            "reason": reason,
            "mapped": sorted(views),
            "total": len(self._rlinfer_specs),
        }

    def _rlinfer_checkpoint_layout(self, checkpoint_dtypes: bool) -> Iterable[tuple[str, torch.Tensor, torch.dtype]]:
        """:meth:`_rlinfer_read_checkpoint` for an engine started with ``load_format="dummy"``:
        names, dtypes and shapes from the safetensors headers (no tensor data read), each as an
        empty tensor on the meta device."""
        import torch

        from rlinfer_core.transfer.disk import read_specs

        served = self.vllm_config.model_config.dtype
        out = []
        for name, spec in read_specs(self.vllm_config.model_config.model).items():
            dtype = getattr(torch, spec.dtype)
            kept = dtype if checkpoint_dtypes or not dtype.is_floating_point else served
            out.append((name, torch.empty(spec.shape, dtype=dtype, device="meta"), kept))
        return out

    def _rlinfer_read_checkpoint(self, checkpoint_dtypes: bool) -> Iterable[tuple[str, torch.Tensor, torch.dtype]]:
        """(name, tensor as read, dtype rlinfer expects updates in) for every checkpoint tensor."""
        from vllm.model_executor.model_loader import get_model_loader

        model_config = self.vllm_config.model_config
        loader = get_model_loader(self.vllm_config.load_config)
        served = model_config.dtype
        for name, tensor in loader.get_all_weights(model_config, self.model_runner.get_model()):
            dtype = tensor.dtype if checkpoint_dtypes or not tensor.is_floating_point() else served
            yield name, tensor, dtype

    def rlinfer_call(self, method: str, *args: Any) -> dict[str, Any]:
        """Run ``rlinfer_<...>`` method ``method`` and return its outcome instead of raising, so
        that every tensor-parallel rank answers every call (see :mod:`rlinfer_vllm.ranks`)."""
        from rlinfer_vllm.ranks import outcome_of

        if not method.startswith("rlinfer_") or method in ("rlinfer_call", "rlinfer_http"):
            raise ValueError(f"rlinfer_call runs rlinfer_* load methods only, not {method!r}")
        return outcome_of(int(self.rank), lambda: getattr(self, method)(*args))

    def rlinfer_http(self, method: str, *args: Any) -> Any:
        """Entry point for calls through a vLLM server's ``/collective_rpc`` (server mode), whose
        arguments arrive as JSON: ``{"b64": ...}`` arguments are decoded to bytes, and only
        ``rlinfer_*`` methods may be called. Results must be JSON (dicts, lists, numbers)."""
        import base64

        if not method.startswith("rlinfer_") or method == "rlinfer_http":
            raise ValueError(f"rlinfer_http calls rlinfer_* methods only, not {method!r}")
        decoded = [base64.b64decode(a["b64"]) if isinstance(a, dict) and set(a) == {"b64"} else a for a in args]
        return getattr(self, method)(*decoded)

    def rlinfer_attach(self, checkpoint_dtypes: bool) -> list[tuple[str, str, list[int]]]:
        """:meth:`rlinfer_init` once per worker: a client attaching to a running server gets the
        specs without rebuilding the shadow (which would forget earlier updates)."""
        specs = getattr(self, "_rlinfer_specs", None)
        if specs is None:
            return self.rlinfer_init(checkpoint_dtypes)
        return [(name, str(dtype).removeprefix("torch."), list(shape)) for name, (dtype, shape) in specs.items()]

    def rlinfer_server_facts(self) -> dict[str, Any]:
        """What a server-mode client cannot read from the engine config over HTTP: vocabulary,
        context length, EOS ids (tokenizer and model config), tied head, quantization, device."""
        config = self.vllm_config
        model_config = config.model_config
        eos: list[int] = []
        chat_template = False
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(
                model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
            )
            if tokenizer.eos_token_id is not None:
                eos.append(int(tokenizer.eos_token_id))
            chat_template = getattr(tokenizer, "chat_template", None) is not None
        except Exception:  # no tokenizer: token-id prompts only
            pass
        hf_eos = getattr(model_config.hf_config, "eos_token_id", None)
        for token in hf_eos if isinstance(hf_eos, list) else [hf_eos]:
            if token is not None and int(token) not in eos:
                eos.append(int(token))
        return {
            "vocab_size": int(model_config.get_vocab_size()),
            "max_model_len": int(model_config.max_model_len),
            "eos_token_ids": eos,
            "tie_word_embeddings": bool(getattr(model_config.hf_config, "tie_word_embeddings", False)),
            "quantized": model_config.quantization is not None,
            "tensor_parallel_size": int(config.parallel_config.tensor_parallel_size),
            "device": str(config.device_config.device_type),
            "chat_template": chat_template,
            "scheduling_policy": str(config.scheduler_config.policy),
        }

    # --- transports ---------------------------------------------------------------------------

    def rlinfer_load_ipc(self, payload: bytes) -> dict[str, float]:
        """Load (name, tensor) pairs shared by :func:`rlinfer_core.transfer.ipc.dumps`."""
        from rlinfer_core.transfer import ipc

        started = time.perf_counter()
        tensors = ipc.loads(payload)
        return self._rlinfer_apply(tensors, map_s=time.perf_counter() - started)

    def rlinfer_load_buckets(self, manifests: bytes, payload: bytes, keep: bool = False) -> dict[str, float]:
        """Load core buckets (pickled manifests, data shared through ipc); ``keep``: ipc.keep_mapped."""
        from rlinfer_vllm.worker.staging import received_buckets

        started = time.perf_counter()
        tensors, reused = received_buckets(manifests, payload, keep)
        return {**self._rlinfer_apply(tensors, map_s=time.perf_counter() - started), "ipc_reused": reused}

    def rlinfer_load_dir(self, path: str) -> dict[str, float]:
        """Load every tensor of a safetensors directory, all checked finite first."""
        from rlinfer_core.transfer.disk import read_checked

        started = time.perf_counter()
        device = "cpu" if self.vllm_config.device_config.device_type == "cpu" else self.device
        tensors = read_checked(path, device)  # the facade checked the headers only
        return self._rlinfer_apply(tensors, map_s=time.perf_counter() - started)

    def rlinfer_join_group(self, fields: dict[str, Any]) -> int:
        """Join the trainer's broadcast group as rank 1 + this worker's rank."""
        from rlinfer_core.transfer.broadcast import create_group, destroy_group
        from rlinfer_core.weights import BroadcastGroup

        if self._rlinfer_group is not None:
            destroy_group(self._rlinfer_group)
            self._rlinfer_group = None
        group = BroadcastGroup(**fields)
        self._rlinfer_group = create_group(group, rank=group.rank_offset + int(self.rank))
        return group.rank_offset + int(self.rank)

    def rlinfer_load_broadcast(self, specs: list[tuple[str, str, list[int]]]) -> dict[str, float]:
        """Receive tensors from rank 0 in ``specs`` order, check them, then load them."""
        from rlinfer_core.errors import WeightUpdateError
        from rlinfer_core.transfer.broadcast import receive
        from rlinfer_core.transfer.validate import nonfinite_problems
        from rlinfer_core.weights import TensorSpec

        if self._rlinfer_group is None:
            raise WeightUpdateError("no broadcast group: call init_weight_broadcast first")
        device = "cpu" if self.vllm_config.device_config.device_type == "cpu" else self.device
        started = time.perf_counter()
        tensors = receive(self._rlinfer_group, [TensorSpec(n, d, tuple(s)) for n, d, s in specs], device)
        problems = nonfinite_problems(tensors)
        if problems:
            raise WeightUpdateError("broadcast weights rejected", tuple(problems))
        return self._rlinfer_apply(tensors, map_s=time.perf_counter() - started)

    def rlinfer_shadow_from_dir(self, path: str) -> None:
        """Note that the engine now serves the checkpoint at ``path`` (loaded by vLLM itself)."""
        self._rlinfer_shadow_dir = path
        for fast in (getattr(self, "_rlinfer_fast", None), getattr(self, "_rlinfer_fp8", None)):
            if fast is not None:
                fast.invalidate()  # vLLM's reload may have replaced parameters
        self._rlinfer_after_reload()

    def rlinfer_weights_checksum(self, tied: dict[str, str]) -> list[tuple[str, str, list[int], str]]:
        """(HF name, dtype, shape, digest) of every checkpoint tensor as the kernels serve it, plus
        the served names in ``tied`` (a tied output head) with the shape of the tensor they tie to.
        See :mod:`rlinfer_vllm.worker.served`."""
        from rlinfer_core.checksum import tensor_checksums
        from rlinfer_vllm.worker.served import served_tensors

        if self.vllm_config.parallel_config.tensor_parallel_size != 1:
            raise NotImplementedError("weight checksums need tensor_parallel_size=1 (each rank holds a shard)")
        names = {name: shape for name, (_, shape) in self._rlinfer_specs.items()}
        for served_name, source in tied.items():
            if served_name not in names and source in names:
                names[served_name] = names[source]
        tensors = served_tensors(self.model_runner.get_model(), names, self.vllm_config.model_config.dtype)
        sums = tensor_checksums([(tensor, None, 0.0, None) for tensor in tensors.values()])
        return [(name, c.dtype, list(c.shape), c.digest) for name, c in zip(tensors, sums, strict=True)]

    def rlinfer_quantized_check(self) -> dict[str, Any]:
        """On a quantized engine: the served weights against the last sent ones, linear layers
        within FP8 rounding and the rest bit for bit (see :mod:`rlinfer_vllm.worker.quantized`)."""
        from rlinfer_vllm.worker.quantized import quantized_check

        shadow = self._rlinfer_shadow
        if shadow is None or self.vllm_config.model_config.quantization is None:
            raise NotImplementedError("the quantized check needs an engine started with quantization")
        if self.vllm_config.parallel_config.tensor_parallel_size != 1:
            raise NotImplementedError("the quantized check needs tensor_parallel_size=1 (each rank holds a shard)")
        self._rlinfer_sync_shadow(shadow)
        sent = shadow if self._rlinfer_fp8 is None else self._rlinfer_fp8.sent(shadow)  # records where stale
        model, dtype = self.model_runner.get_model(), self.vllm_config.model_config.dtype
        return quantized_check(model, sent, dtype, self._rlinfer_specs)

    # --- loading ------------------------------------------------------------------------------

    def _rlinfer_apply(self, tensors: Sequence[Pair], map_s: float) -> dict[str, float]:
        """Load ``tensors`` all-or-nothing; return how many, and the seconds spent getting them
        (``map_s``: mapping, reading or receiving) and loading them (``load_s``, checks included);
        ``fast_load``: 1.0 where one batched copy loaded them (:mod:`rlinfer_vllm.worker.fast_load`), with
        ``fast_plan_s``, the time spent finding the parameter slices (0 once cached); ``fast_fp8``: 1.0
        where an FP8 engine quantized them itself (:mod:`rlinfer_vllm.worker.fp8_load`)."""
        from rlinfer_core.fault_plan import planted

        started = time.perf_counter()
        self._rlinfer_check(tensors)
        tensors = planted(tensors)
        fast = getattr(self, "_rlinfer_fast", None)
        timings: dict[str, float] = {"tensors": len(tensors), "map_s": map_s}
        if self._rlinfer_shadow is None:
            timings["fast_load"] = 1.0 if self._rlinfer_load_in_place(tensors, fast) else 0.0
            if fast is not None:
                timings["fast_plan_s"] = fast.plan_s
        else:
            fp8 = self._rlinfer_fp8
            timings.update(fast_load=0.0, fast_fp8=float(fp8 is not None and fp8.load(tensors)))
            timings.update({} if fp8 is None else {"fast_plan_s": fp8.plan_s})
            if not timings["fast_fp8"]:
                timings["shadow_s"] = self._rlinfer_reload(tensors, self._rlinfer_shadow)
        timings["load_s"] = time.perf_counter() - started
        return timings

    def _rlinfer_load_in_place(self, tensors: Sequence[Pair], fast: FastLoader | None) -> bool:
        """Load ``tensors`` in place, with one batched copy where ``fast`` can (returns True),
        else through ``load_weights``."""
        import torch

        from rlinfer_core.errors import WeightUpdateError

        try:
            done = fast is not None and fast.load(tensors)
            if not done:
                self.model_runner.get_model().load_weights(iter(tensors))
            # the sender frees (or reuses) its buffers once this call returns
            torch.cuda.current_stream().synchronize()
            return done
        except Exception as exc:
            raise WeightUpdateError(
                "vLLM failed while loading in place; the engine may hold a partial update: send a full one",
                (f"{type(exc).__name__}: {exc}",),
            ) from exc

    def _rlinfer_on_cuda(self) -> bool:
        return bool(self.vllm_config.device_config.device_type == "cuda")

    def _rlinfer_reload(self, tensors: Sequence[Pair], shadow: dict[str, torch.Tensor]) -> float:
        """Reload through vLLM (see the module docstring); the seconds spent copying the update
        into the shadow."""
        given = dict(tensors)
        full = len(given) == len(shadow)
        if full:
            items: list[Pair] = list(given.items())
        else:
            self._rlinfer_sync_shadow(shadow)
            if self._rlinfer_fp8 is not None:  # the fast FP8 path leaves the shadow behind
                self._rlinfer_fp8.require_fresh(name for name in shadow if name not in given)
            items = [(name, given.get(name, old)) for name, old in shadow.items()]
        try:
            self.reload_weights(weights_iterator=iter(items))  # type: ignore[attr-defined]
        except BaseException:
            self._rlinfer_restore(shadow)
            raise
        self._rlinfer_after_reload()
        started = time.perf_counter()
        for name, tensor in given.items():
            shadow[name].copy_(tensor, non_blocking=True)
        if self._rlinfer_on_cuda():
            import torch

            # the sender frees (or reuses) its buffers once this call returns
            torch.cuda.current_stream().synchronize()
        if full:
            self._rlinfer_shadow_dir = None  # every entry was just overwritten
        if self._rlinfer_fp8 is not None:
            self._rlinfer_fp8.refreshed(given)
        return time.perf_counter() - started

    def _rlinfer_check(self, tensors: Sequence[Pair]) -> None:
        """Names, shapes and dtypes against the checkpoint's, before anything is loaded.

        The facade checked them already; this keeps the worker safe on its own, because a load
        that fails halfway leaves vLLM's layers half-rebuilt.
        """
        from rlinfer_core.errors import WeightUpdateError

        problems = []
        seen: set[str] = set()
        for name, tensor in tensors:
            want = self._rlinfer_specs.get(name)
            if name in seen:
                problems.append(f"{name}: duplicate name in one update")
            elif want is None:
                problems.append(f"{name}: unknown parameter name")
            elif (tensor.dtype, tuple(tensor.shape)) != want:
                problems.append(f"{name}: {tensor.dtype} {tuple(tensor.shape)} != expected {want[0]} {want[1]}")
            seen.add(name)
        if problems:
            raise WeightUpdateError("weight update rejected by the vLLM worker", tuple(problems))

    def _rlinfer_restore(self, shadow: dict[str, torch.Tensor]) -> None:
        """After a reload failed inside vLLM: unwind its layer-wise reload state, then reload the
        shadow (the weights served before the failed update)."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        # finalize puts untouched layers' kernel tensors back and resets the per-layer state, so
        # that the next reload starts clean instead of skipping half-initialised layers
        finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        self._rlinfer_sync_shadow(shadow)
        if self._rlinfer_fp8 is not None:  # weights served before were loaded fast: the shadow lacks them
            self._rlinfer_fp8.require_restorable()
        self.reload_weights(weights_iterator=iter(list(shadow.items())))  # type: ignore[attr-defined]
        self._rlinfer_after_reload()

    def _rlinfer_after_reload(self) -> None:
        """Redo the kernel processing that vLLM's layer-wise reload skips: tied modules', and the
        CPU expert kernels' repacking (see :mod:`rlinfer_vllm.worker.experts`).

        The reload loads a tied tensor (``model.embed_tokens.weight``) through one module only; the
        module tied to it (``lm_head``) loads nothing, so vLLM puts its old kernel tensors back and
        never re-runs its ``process_weights_after_loading``. Its tensor is shared and holds the new
        values, but on CPU the GEMM multiplies by a packed copy made at start: the served head kept
        the old weights. Re-processing repacks it from the shared tensor.
        """
        from rlinfer_vllm.worker.experts import redo_expert_packing
        from rlinfer_vllm.worker.served import reprocess

        reprocess(self._rlinfer_tied)
        redo_expert_packing(self.model_runner.get_model())

    def _rlinfer_sync_shadow(self, shadow: dict[str, torch.Tensor]) -> None:
        """After a raw vLLM reload from disk, refresh the shadow from that directory."""
        path = self._rlinfer_shadow_dir
        if path is None:
            return
        from rlinfer_core.transfer.disk import read_tensors

        for name, tensor in read_tensors(path):
            if name in shadow:
                shadow[name].copy_(tensor)
        if self._rlinfer_fp8 is not None:  # the shadow holds what vLLM loaded from the directory
            self._rlinfer_fp8.refreshed(shadow)
        self._rlinfer_shadow_dir = None
