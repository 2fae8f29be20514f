"""rlinfer on Ray: many engine replicas behind the one rlinfer contract.

The pool is a backend (:class:`PoolBackend`) under the one :class:`rlinfer_core.engine.AsyncEngine`:
:func:`open_async_pool` returns that engine over N replicas, each an engine of any backend
inside a Ray actor; :func:`open_pool` its blocking twin, an :class:`rlinfer_core.engine.Engine`.
:func:`pool_backend` reaches the pool's own controls (router, replica states, restarts).
Importing this package does not import Ray; the pool does when it opens.
"""

from rlinfer_ray.config import PoolConfig, RouterPolicy
from rlinfer_ray.pool import PoolBackend, open_async_pool, open_pool, pool_backend

__all__ = ["PoolBackend", "PoolConfig", "RouterPolicy", "open_async_pool", "open_pool", "pool_backend"]
