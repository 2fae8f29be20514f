"""Weight-transfer primitives shared by every backend (trainer side and engine side).

- :mod:`.buckets`: pack named tensors into per-dtype byte buckets with a manifest and checksum.
- :mod:`.validate`: check an update against the engine's parameter specs before loading.
- :mod:`.disk`: safetensors checkpoint directories.
- :mod:`.ipc`: share tensors with another process (shared memory on CPU, CUDA IPC on GPU).
- :mod:`.broadcast`: a torch.distributed group between trainer and engine (gloo / NCCL).

Every module imports torch lazily or at its own import; ``import rlinfer_core`` never does.
"""
