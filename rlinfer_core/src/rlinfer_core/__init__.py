"""rlinfer core: one contract for RL rollout engines (generate, weight sync, memory control).

Importing this package imports neither torch nor any engine.
"""

from rlinfer_core.checksum import WeightChecksum, WeightVerification
from rlinfer_core.discovery import BackendInfo, discover, get_backend
from rlinfer_core.engine import AsyncEngine, Engine, open_engine
from rlinfer_core.errors import (
    BackendLoadError,
    BackendNotFound,
    EngineDead,
    EngineOutOfMemory,
    EngineTimeout,
    InvalidRequest,
    RLInferError,
    UnsupportedCapability,
    WeightUpdateError,
    WeightVerificationError,
)
from rlinfer_core.hookspecs import hookimpl
from rlinfer_core.model_info import ModelInfo
from rlinfer_core.oom_retry import OutOfMemoryRetry
from rlinfer_core.types import (
    Capabilities,
    Capability,
    ChatMessage,
    Completion,
    CompletionDelta,
    EngineConfig,
    FinishReason,
    GenerateRequest,
    LogprobsMode,
    MemoryTag,
    PauseMode,
    SamplingParams,
)
from rlinfer_core.weights import (
    BroadcastGroup,
    BroadcastSource,
    Bucket,
    BucketManifest,
    Buckets,
    CheckpointDir,
    ManifestEntry,
    NamedTensors,
    TensorSpec,
    WeightUpdate,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncEngine",
    "BackendInfo",
    "BackendLoadError",
    "BackendNotFound",
    "BroadcastGroup",
    "BroadcastSource",
    "Bucket",
    "BucketManifest",
    "Buckets",
    "Capabilities",
    "Capability",
    "ChatMessage",
    "CheckpointDir",
    "Completion",
    "CompletionDelta",
    "Engine",
    "EngineConfig",
    "EngineDead",
    "EngineOutOfMemory",
    "EngineTimeout",
    "FinishReason",
    "GenerateRequest",
    "InvalidRequest",
    "LogprobsMode",
    "ManifestEntry",
    "MemoryTag",
    "ModelInfo",
    "OutOfMemoryRetry",
    "NamedTensors",
    "PauseMode",
    "RLInferError",
    "SamplingParams",
    "TensorSpec",
    "UnsupportedCapability",
    "WeightChecksum",
    "WeightUpdate",
    "WeightVerification",
    "WeightUpdateError",
    "WeightVerificationError",
    "discover",
    "get_backend",
    "hookimpl",
    "open_engine",
]
