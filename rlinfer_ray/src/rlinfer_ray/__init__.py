"""rlinfer on Ray: many engine replicas behind the one rlinfer contract.

:class:`EnginePool` has the API of :class:`rlinfer_core.engine.AsyncEngine` over N replicas, each
an ``AsyncEngine`` of any backend inside a Ray actor; :class:`SyncEnginePool` (``open_pool``) is
the blocking twin of :class:`rlinfer_core.engine.Engine`. Importing this package does not import
Ray; the pool does when it opens.
"""

from rlinfer_ray.config import PoolConfig, RouterPolicy
from rlinfer_ray.pool import EnginePool
from rlinfer_ray.sync import SyncEnginePool, open_pool

__all__ = ["EnginePool", "PoolConfig", "RouterPolicy", "SyncEnginePool", "open_pool"]
