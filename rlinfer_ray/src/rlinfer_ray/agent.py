"""Agent rollouts on a pool: sessions and scoring run on the pool's own ``generate`` (so they
are routed like any request); tool-call parsing goes to one replica; LoRA adapters are loaded
on every replica (fan-out). A replica restarted later does not get adapters back: load them
again (see docs/fleet.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlinfer_core.lora import LoraAdapter, LoraInfo
    from rlinfer_core.scoring import Score, ScoreRequest
    from rlinfer_core.session import AsyncSession
    from rlinfer_core.tool_loop import ToolLoopConfig
    from rlinfer_core.tool_runner import Prompt, SamplingPolicy, ToolEpisode
    from rlinfer_core.tools import ToolCalls
    from rlinfer_core.types import SamplingParams
    from rlinfer_ray.pool import EnginePool


class PoolAgent:
    """Sessions, scoring, tool calls and LoRA for :class:`~rlinfer_ray.pool.EnginePool`."""

    def _pool(self) -> EnginePool:
        return self  # type: ignore[return-value]  # always mixed into EnginePool

    def session(self, messages: Any = None, **kwargs: Any) -> AsyncSession:
        """See ``AsyncEngine.session``; every model turn is routed by the pool."""
        from rlinfer_core.session import AsyncSession

        pool = self._pool()
        pool._ensure_open()
        return AsyncSession(pool, messages=messages, **kwargs)  # type: ignore[arg-type]

    async def score(self, requests: ScoreRequest | Sequence[ScoreRequest]) -> list[Score]:
        """See ``AsyncEngine.score``."""
        from rlinfer_core.scoring import score

        return await score(self._pool(), requests)  # type: ignore[arg-type]

    async def parse_tool_calls(self, text: str, parser: str, tools: Any = None) -> ToolCalls:
        """See ``AsyncEngine.parse_tool_calls`` (answered by one serving replica)."""
        pool = self._pool()
        pool._ensure_open()
        replica = pool.replicas.serving()[0] if pool.replicas.serving() else pool.replicas.replicas[0]
        result: ToolCalls = await pool.replicas.call(
            replica, "parse_tool_calls", text, parser, tools, timeout=pool.pool_config.control_timeout_s
        )
        return result

    async def run_tool_loop(
        self,
        prompts: Sequence[Prompt],
        config: ToolLoopConfig,
        sampling: SamplingParams | SamplingPolicy | None = None,
    ) -> list[ToolEpisode]:
        """See ``AsyncEngine.run_tool_loop``: one pool session per prompt, every turn routed."""
        from rlinfer_core.tool_runner import run_tool_loop

        return await run_tool_loop(self._pool(), prompts, config, sampling)  # type: ignore[arg-type]

    async def _lora_fan_out(self, method: str, *args: Any) -> Any:
        pool = self._pool()
        pool._ensure_open()
        members = pool.replicas.serving()
        results = await pool.replicas.fan_out(
            members, lambda r: pool.replicas.call(r, method, *args, timeout=pool.config.request_timeout_s)
        )
        pool._raise_first(results)
        return results[min(results)] if results else None

    async def load_lora(self, adapter: LoraAdapter) -> LoraInfo:
        """See ``AsyncEngine.load_lora``: on every replica."""
        import ray

        result: LoraInfo = await self._lora_fan_out("load_lora", ray.put(adapter))
        return result

    async def update_lora(self, adapter: LoraAdapter) -> LoraInfo:
        """See ``AsyncEngine.update_lora``: on every replica."""
        import ray

        result: LoraInfo = await self._lora_fan_out("update_lora", ray.put(adapter))
        return result

    async def unload_lora(self, name: str) -> None:
        """See ``AsyncEngine.unload_lora``: on every replica."""
        await self._lora_fan_out("unload_lora", name)

    async def list_loras(self) -> list[LoraInfo]:
        """See ``AsyncEngine.list_loras`` (the adapters of the first serving replica)."""
        result: list[LoraInfo] = await self._lora_fan_out("list_loras")
        return result
