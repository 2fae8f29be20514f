"""The ``verl.plugins`` entry point: ``import verl`` imports this module, which calls :func:`register`
(verl only loads an entry point, so registering is the import's side effect).

It makes ``rollout.name: rlinfer`` a verl rollout: verl's ``RolloutReplicaRegistry`` returns
:class:`rlinfer_verl.replica.RlinferReplica` and ``get_rollout_class("rlinfer", "async")``
:class:`rlinfer_verl.adapter.ServerAdapter`. verl logs a failing plugin only at debug level, so
the version check also logs its error (see :mod:`rlinfer_verl`).
"""

from __future__ import annotations

from typing import Any

from rlinfer_verl.config import ROLLOUT_NAME

#: the adapter verl's ``get_rollout_class`` imports by name
ADAPTER = "rlinfer_verl.adapter.ServerAdapter"


def _load_replica() -> Any:
    from rlinfer_verl.replica import RlinferReplica

    return RlinferReplica


def register() -> None:
    """Register rlinfer's rollout in verl's registries (idempotent)."""
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, _load_replica)
    _ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = ADAPTER


register()
