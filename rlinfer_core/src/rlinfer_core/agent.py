"""The facade's side of issue 13 (agent rollouts), kept out of engine.py: derived capabilities,
the capabilities the new request fields need, and tool-call parsing around ``generate``.

Derived capabilities (decided here, applied by the facade and by ``rlinfer backends``):

* ``sessions`` is built by the facade on plain generate with token ids, which every backend has,
  so it is always added. (Sessions need the model's HF tokenizer files, a property of the model,
  not the backend: :class:`~rlinfer_core.session.AsyncSession` reports their absence.)
* ``score`` is built on ``generate.prompt_logprobs`` (:mod:`rlinfer_core.scoring`) and added
  exactly where the backend claims that.
* ``weights.delta`` is built on ``weights.tensors`` (the facade checks the delta's base version
  and loads its tensors as a partial named-tensor update) and added exactly where that is claimed.

A backend may also claim them itself; a backend cannot refuse them except by not claiming what
they are built on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from rlinfer_core.backend import ToolsBackend
from rlinfer_core.tools import ToolCalls, check_calls, check_parser, to_tools
from rlinfer_core.types import Capabilities, Capability, Completion, GenerateRequest

if TYPE_CHECKING:
    from rlinfer_core.engine import AsyncEngine

#: capability -> (what it is built on, the note ``rlinfer backends`` shows)
DERIVED: dict[Capability, tuple[Capability | None, str]] = {
    Capability.SESSIONS: (None, "built by the facade on generate with prompt token ids (rlinfer_core.session)"),
    Capability.SCORE: (
        Capability.PROMPT_LOGPROBS,
        "built by the facade on generate.prompt_logprobs (rlinfer_core.scoring); raw logprobs",
    ),
    Capability.WEIGHTS_DELTA: (
        Capability.WEIGHTS_TENSORS,
        "built by the facade on weights.tensors: base_version checked, the changed tensors loaded as a "
        "partial named-tensor update (rlinfer_core.delta finds them on the trainer side)",
    ),
}


def derive_capabilities(caps: Capabilities) -> Capabilities:
    """``caps`` plus the capabilities the facade builds on them (see the module docstring). One
    that ``caps`` notes without claiming it is one the backend turned off, with that note as the
    reason (rlinfer_ray's pool cannot replay a delta to a restarted replica): not added."""
    added = {
        c
        for c, (base, _) in DERIVED.items()
        if c not in caps.supported and c.value not in caps.notes and (base is None or base in caps.supported)
    }
    lacking = {
        c.value: f"built by the facade on {base.value}, which this backend does not support here"
        for c, (base, _) in DERIVED.items()
        if c not in caps.supported and base is not None and base not in caps.supported and c.value not in caps.notes
    }
    if not added and not lacking:
        return caps
    notes = {**caps.notes, **lacking}
    for c in added:
        notes.setdefault(c.value, DERIVED[c][1])
    return attrs.evolve(caps, supported=caps.supported | added, notes=notes)


def agent_request_capabilities(request: GenerateRequest) -> list[Capability]:
    """The capabilities the issue-13 fields of ``request`` need (tools, structured, lora)."""
    needed = []
    if request.tools is not None or request.tool_parser is not None:
        needed.append(Capability.TOOLS)
    if request.sampling.structured is not None:
        needed.append(Capability.STRUCTURED)
    if request.lora is not None:
        needed.append(Capability.LORA)
    return needed


def check_agent_request(engine: AsyncEngine, request: GenerateRequest) -> None:
    """Capabilities for the new fields, and the adapter a request names must be loaded."""
    for capability in agent_request_capabilities(request):
        engine.capabilities.require(capability)
    if request.lora is not None:
        from rlinfer_core.lora import registry

        registry(engine).check_request(request)


async def parse_tool_calls(engine: AsyncEngine, text: str, parser: str, tools: Any) -> ToolCalls:
    """Tool calls in ``text`` by the engine's ``parser`` ("hermes", "qwen", "llama"), checked
    against ``tools`` (unknown tools and schema-invalid arguments are marked malformed)."""
    engine._calls.ensure_open()
    check_parser(parser)
    specs = to_tools(tools) or ()
    parse: Any = engine._calls.optional(ToolsBackend.rlinfer_parse_tool_calls)
    found = parse(text=text, parser=parser, tools=specs)
    if isinstance(found, Awaitable):  # a backend may parse asynchronously although the spec says sync
        found = await engine._calls.with_timeout(found, engine.config.request_timeout_s, "parse_tool_calls")
    if not isinstance(found, ToolCalls):
        raise TypeError(f"rlinfer_parse_tool_calls of {engine.backend_name!r} returned {type(found).__name__}")
    return check_calls(found, specs)


async def attach_tool_calls(
    engine: AsyncEngine, requests: Sequence[GenerateRequest], completions: Sequence[Completion]
) -> list[Completion]:
    """Set ``tool_calls`` on completions of requests with a ``tool_parser`` (token ids unchanged)."""
    wanted = {r.request_id: r for r in requests if r.tool_parser is not None}
    if not wanted:
        return list(completions)
    from rlinfer_core.chat_template import load_tokenizer

    tokenizer = load_tokenizer(engine.config.tokenizer or engine.config.model)
    eos = set(engine.model_info.eos_token_ids) if engine.model_info is not None else set()
    out = []
    for c in completions:
        r = wanted.get(c.request_id)
        if r is not None and r.tool_parser is not None:
            ids = list(c.token_ids)
            if ids and ids[-1] in eos:
                ids = ids[:-1]
            text = tokenizer.decode(ids, skip_special_tokens=False)
            c = attrs.evolve(c, tool_calls=await parse_tool_calls(engine, text, r.tool_parser, r.tools or ()))
        out.append(c)
    return out
