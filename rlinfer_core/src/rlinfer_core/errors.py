"""Typed errors: one base class, one subclass per thing a caller can act on.

Every message says what was wrong and what to do about it.
"""

from __future__ import annotations

from typing import Any


class RLInferError(Exception):
    """Base class of every error rlinfer raises on purpose. Pickles whole (type, message and
    attributes), so it crosses process boundaries such as Ray actor calls as itself."""

    def __reduce__(self) -> tuple[Any, ...]:
        # each subclass has its own __init__ arguments: rebuild without calling it
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type[RLInferError], args: tuple[Any, ...], state: dict[str, Any]) -> RLInferError:
    exc = cls.__new__(cls)
    Exception.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class BackendNotFound(RLInferError, LookupError):
    """No installed backend has the requested name (the message lists those that are)."""


class BackendLoadError(RLInferError):
    """A backend was found but cannot be used: import failure, missing or unsupported engine."""


class UnsupportedCapability(RLInferError, NotImplementedError):
    """The backend, on this platform, does not support the requested operation.

    Raised instead of a silent no-op; ``capability`` names what was asked for.
    """

    def __init__(self, capability: str, backend: str, reason: str = "") -> None:
        self.capability = capability
        self.backend = backend
        self.reason = reason
        detail = f": {reason}" if reason else ""
        super().__init__(
            f"backend {backend!r} does not support {capability!r} on this platform{detail}. "
            f"Check Engine.capabilities before calling."
        )


class InvalidRequest(RLInferError, ValueError):
    """A value given by the caller is out of its allowed range; ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"invalid {field}: {message}")


class WeightUpdateError(RLInferError):
    """A weight update was rejected or failed; the engine still serves the previous weights.

    ``problems`` lists every problem found (validation reports all of them, not just the first).
    """

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        self.problems = problems
        listed = "".join(f"\n  - {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        super().__init__(f"{message}{listed}{more}\nThe engine still serves the previous weights and version.")


class WeightVerificationError(WeightUpdateError):
    """The engine loaded an update but does not serve it exactly: its own checksums of the updated
    tensors differ from the trainer's (``mismatched``) or were not reported (``missing``).

    Raised by ``update_weights`` under ``EngineConfig.verify_updates``. The engine then serves
    neither the old nor the new policy, so generation is refused (WeightsNotLoaded) until a full
    update loads and verifies; the weight version is not advanced.
    """

    def __init__(self, message: str, mismatched: tuple[str, ...], missing: tuple[str, ...]) -> None:
        self.mismatched = mismatched
        self.missing = missing
        problems = tuple(f"{n}: served bytes differ" for n in mismatched) + tuple(
            f"{n}: not reported by the engine" for n in missing
        )
        self.problems = problems
        listed = "".join(f"\n  - {p}" for p in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        RLInferError.__init__(
            self,
            f"{message}{listed}{more}\nGeneration is refused until a full update loads and verifies.",
        )


class WeightStagingError(WeightUpdateError):
    """A staged weight update (``stage_weights``, capability ``weights.staged``) cannot go on:
    another staging is open, the handle was already committed or cancelled, or ``update_weights``
    was called while a staging is open. The engine still serves the previous weights and version."""


class StagingLimitExceeded(WeightStagingError):
    """Staging this update would hold more than ``EngineConfig.max_staged_weight_bytes`` in the
    engine (``staged_bytes`` already held, ``requested`` more, ``limit``); nothing of it was staged.
    Commit what is staged first, or raise the bound."""

    def __init__(self, staged_bytes: int, requested: int, limit: int) -> None:
        self.staged_bytes = staged_bytes
        self.requested = requested
        self.limit = limit
        super().__init__(
            f"staging {requested} more bytes would hold {staged_bytes + requested} bytes in the engine, over "
            f"EngineConfig.max_staged_weight_bytes={limit}; nothing of this update was staged"
        )


class WeightsNotLoaded(RLInferError):
    """The engine holds no valid weights: they were released with ``discard_weights=True``.

    Generation, scoring, sessions and checksums are refused until a full ``update_weights``
    (every name of ``Engine.weight_specs``) has loaded; partial and delta updates are refused too.
    """


class EngineDead(RLInferError):
    """The engine process died or was shut down; open a new engine."""


class EngineTimeout(RLInferError, TimeoutError):
    """An operation did not finish within its timeout (``EngineConfig.request_timeout_s``)."""


class EngineOutOfMemory(RLInferError):
    """A request cannot get the KV-cache room it needs; the engine keeps serving, no other
    request is affected, and the refused request ran nowhere (no partial tokens).

    ``transient`` False: the request can never fit this engine's KV cache, even alone
    (``needed_tokens`` > ``capacity_tokens``, read from the engine); shorten it or start the
    engine with a larger ``kv_cache_memory_bytes``. True: it could fit an emptier cache; the
    engine turned it away under pressure from other requests, and a later retry may pass
    (``rlinfer_core.oom_retry.OutOfMemoryRetry`` retries these, off by default).
    An engine that itself died of memory raises :class:`EngineDead` instead.
    """

    def __init__(
        self,
        message: str,
        *,
        transient: bool,
        needed_tokens: int | None = None,
        capacity_tokens: int | None = None,
    ) -> None:
        self.transient = transient
        self.needed_tokens = needed_tokens
        self.capacity_tokens = capacity_tokens
        super().__init__(message)
