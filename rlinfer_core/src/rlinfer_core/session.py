"""Sessions (capability ``sessions``): one multi-turn episode with token continuity.

    session = engine.session(tools=[calculator], tool_parser="hermes")
    session.add_message("user", "what is 2 + 3?")
    turn = session.generate(SamplingParams(temperature=1.0, max_tokens=64))
    for call in turn.tool_calls.calls if turn.tool_calls else ():
        session.add_tool_result(run(call))
    session.generate()
    episode = session.result()   # token_ids, loss_mask, logprobs, token_versions

Rules (see docs/agents.md):

* The prompt of every model turn is **exactly** the session's token ids so far: the model's own
  ids are kept as generated and never re-tokenised from decoded text.
* Environment turns (user and tool messages, raw text or tokens) are rendered with the model's
  chat template **incrementally**: the new text is the whole-conversation rendering minus what
  the session already holds, tokenised on its own. Template text around the model's output
  (the generation prompt, the end-of-turn marker) counts as template tokens.
* ``loss_mask`` is 1 on model tokens, 0 on environment and template tokens; ``logprobs`` and
  ``token_versions`` are the engine's for model tokens and 0.0 / -1 elsewhere.
* Where the template cannot be applied incrementally (it rewrites earlier turns) the session
  raises :class:`~rlinfer_core.chat_template.TemplateContinuityError` (``strict=True``, the
  default) or flags the turn ``exact=False`` with a note (``strict=False``).
* Generation goes through the facade's ``generate``, so sessions work on every backend, reuse the
  engine's prefix cache, and survive weight updates between turns (tokens carry their version).
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import attrs

from rlinfer_core.chat_template import ChatTemplate, Delta, TemplateContinuityError, load_tokenizer
from rlinfer_core.errors import InvalidRequest
from rlinfer_core.multimodal import Image, content_images, template_content, to_content
from rlinfer_core.sync_twin import Delegated, SyncTwin, blocking, converted, delegated, delegated_property
from rlinfer_core.tools import ToolCalls, ToolSpec, check_parser, to_tools
from rlinfer_core.types import Capability, Completion, FinishReason, GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from rlinfer_core.engine import AsyncEngine
    from rlinfer_core.sync_engine import Engine

T = TypeVar("T")
Y = TypeVar("Y")
TurnKind = Literal["model", "environment", "template"]
#: token_versions of tokens the model did not produce
NO_VERSION = -1


@attrs.frozen
class Turn:
    """One span of the session's tokens: ``token_ids[start:end]`` of the whole sequence."""

    kind: TurnKind
    start: int
    end: int
    role: str | None = None  #: chat role of an environment turn ("user", "tool", ...)
    text: str | None = None  #: the text this turn added (decoded model output for model turns)
    completion: Completion | None = None  #: the engine's completion (model turns)
    tool_calls: ToolCalls | None = None  #: calls parsed from a model turn (session tool_parser)
    exact: bool = True  #: False where the template could not be followed (see ``note``)
    note: str | None = None


@attrs.frozen
class SessionResult:
    """The episode, ready for a trainer: one entry per token in every tuple."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]  #: 1 on model tokens, 0 on environment and template tokens
    logprobs: tuple[float, ...]  #: the engine's logprob on model tokens, 0.0 elsewhere
    token_versions: tuple[int, ...]  #: weight version of model tokens, -1 elsewhere
    turns: tuple[Turn, ...]
    messages: tuple[Mapping[str, Any], ...]  #: the conversation as chat messages (chat sessions)
    exact: bool  #: True when every turn followed the chat template exactly


class AsyncSession:
    """One episode on an :class:`~rlinfer_core.engine.AsyncEngine`. Build it with
    ``engine.session(...)``; ``generate`` is a coroutine, everything else is local."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        messages: Sequence[Mapping[str, Any]] | None = None,
        prompt_token_ids: Sequence[int] | None = None,
        tools: Any = None,
        tool_parser: str | None = None,
        sampling: SamplingParams | None = None,
        chat_template: bool = True,
        strict: bool = True,
        lora: str | None = None,
    ) -> None:
        engine.capabilities.require(Capability.SESSIONS)
        check_parser(tool_parser)
        if tool_parser is not None:
            engine.capabilities.require(Capability.TOOLS)
        if sampling is not None and sampling.n != 1:
            raise InvalidRequest("sampling.n", f"a session holds one trajectory: n must be 1, got {sampling.n}")
        self.engine = engine
        self.tools: tuple[ToolSpec, ...] | None = to_tools(tools)
        self.tool_parser = tool_parser
        self.sampling = sampling or SamplingParams()
        self.strict = strict
        self.lora = lora
        self.template: ChatTemplate | None = None
        if chat_template:
            tokenizer = load_tokenizer(engine.config.tokenizer or engine.config.model)
            self.template = ChatTemplate(tokenizer, [t.to_openai() for t in self.tools] if self.tools else None)
        elif self.tools is not None:
            raise InvalidRequest("tools", "tools are rendered by the chat template; chat_template=False has none")
        self.messages: list[dict[str, Any]] = []
        self._rendered = ""  # the template's rendering of self.messages (chat sessions)
        self._ids: list[int] = []
        self._mask: list[int] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._images: list[Image] = []  # the messages' images, in prompt order
        self.turns: list[Turn] = []
        if prompt_token_ids is not None:
            if self.template is not None:
                raise InvalidRequest("prompt_token_ids", "a chat session starts from messages; use chat_template=False")
            self.add_tokens(prompt_token_ids)
        for message in messages or ():
            self.add_message(**dict(message))

    # --- state ---------------------------------------------------------------------------------

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every token so far (the next model turn's prompt)."""
        return tuple(self._ids)

    @property
    def exact(self) -> bool:
        """True when every turn followed the chat template exactly."""
        return all(t.exact for t in self.turns)

    def result(self) -> SessionResult:
        """The episode so far (see :class:`SessionResult`)."""
        return SessionResult(
            tuple(self._ids),
            tuple(self._mask),
            tuple(self._logprobs),
            tuple(self._versions),
            tuple(self.turns),
            tuple(copy.deepcopy(self.messages)),
            self.exact,
        )

    def fork(self) -> AsyncSession:
        """An independent copy (e.g. several continuations of one prefix for a GRPO group)."""
        twin = copy.copy(self)
        for name in ("messages", "_ids", "_mask", "_logprobs", "_versions", "turns", "_images"):
            setattr(twin, name, copy.deepcopy(getattr(self, name)) if name == "messages" else list(getattr(self, name)))
        return twin

    def _append(self, kind: TurnKind, ids: Sequence[int], **turn: Any) -> Turn:
        start = len(self._ids)
        self._ids.extend(ids)
        if kind == "model":
            completion: Completion = turn["completion"]
            self._mask.extend([1] * len(ids))
            self._logprobs.extend(completion.logprobs)
            self._versions.extend(completion.token_versions or [completion.weight_version] * len(ids))
        else:
            self._mask.extend([0] * len(ids))
            self._logprobs.extend([0.0] * len(ids))
            self._versions.extend([NO_VERSION] * len(ids))
        record = Turn(kind, start, len(self._ids), **turn)
        self.turns.append(record)
        return record

    def _check(self, delta: Delta) -> None:
        if not delta.exact and self.strict:
            raise TemplateContinuityError(delta.note or "the rendering changed")

    # --- environment turns -----------------------------------------------------------------

    def add_message(self, /, role: str, content: str | Sequence[Any], **fields: Any) -> Turn:
        """Append a chat message from the environment (``user``, ``tool``, ``system``), rendered
        by the chat template; extra ``fields`` (e.g. ``name``, ``tool_call_id``) go to the
        template. Model turns come from :meth:`generate`, not from here. ``content`` may hold image
        parts (:mod:`rlinfer_core.multimodal`): their placeholders enter the session expanded by
        the model's HF processor, and every later generation sends the session's images along."""
        template = self._need_template("add_message")
        if role == "assistant":
            raise InvalidRequest("role", "assistant turns are generated; use generate()")
        parts = to_content(content, "content")
        images = content_images(parts)
        message = {"role": role, "content": template_content(parts), **fields}
        after = template.render([*self.messages, message], add_generation_prompt=False)
        base = self.messages[-1:]
        fallback = (template.render(base, False), template.render([*base, message], False)) if base else None
        delta = template.delta(self._rendered, after, fallback, f"adding a {role} message")
        self._check(delta)
        ids = template.encode_with_images(delta.text, images) if images else template.encode(delta.text)
        self.messages.append(message)
        self._rendered = after
        self._images.extend(images)
        return self._append("environment", ids, role=role, text=delta.text, exact=delta.exact, note=delta.note)

    def add_tool_result(self, content: str, *, name: str | None = None, tool_call_id: str | None = None) -> Turn:
        """Append a tool's result as a ``tool`` message."""
        fields = {k: v for k, v in (("name", name), ("tool_call_id", tool_call_id)) if v is not None}
        return self.add_message("tool", content, **fields)

    def add_tokens(self, token_ids: Sequence[int], text: str | None = None) -> Turn:
        """Append raw environment tokens (sessions without a chat template)."""
        if self.template is not None:
            raise InvalidRequest(
                "session", "a chat session takes messages (add_message); raw tokens bypass the template"
            )
        ids = list(token_ids)
        if not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
            raise InvalidRequest("token_ids", f"must be a non-empty list of token ids >= 0, got {token_ids!r}")
        return self._append("environment", ids, text=text)

    def add_text(self, text: str) -> Turn:
        """Append raw environment text, tokenised on its own (sessions without a chat template)."""
        if self.template is not None:
            raise InvalidRequest(
                "session", "a chat session takes messages (add_message); raw text bypasses the template"
            )
        tokenizer = load_tokenizer(self.engine.config.tokenizer or self.engine.config.model)
        return self.add_tokens(tokenizer(text, add_special_tokens=False).input_ids, text=text)

    def _need_template(self, what: str) -> ChatTemplate:
        if self.template is None:
            raise InvalidRequest("session", f"{what} needs the chat template; this session has chat_template=False")
        return self.template

    # --- model turns -----------------------------------------------------------------------

    def _request(self, sampling: SamplingParams | None, request_id: str | None) -> GenerateRequest:
        params = sampling or self.sampling
        if params.n != 1:
            raise InvalidRequest("sampling.n", f"a session holds one trajectory: n must be 1, got {params.n}")
        if self.template is not None:
            extra = [t for t in self.template.end_of_turn_ids if t not in params.stop_token_ids]
            if extra and not params.ignore_eos:
                params = attrs.evolve(params, stop_token_ids=(*params.stop_token_ids, *extra))
        fields: dict[str, Any] = {"prompt_token_ids": tuple(self._ids), "sampling": params, "images": self._images}
        if request_id is not None:
            fields["request_id"] = request_id
        if self.lora is not None:
            fields["lora"] = self.lora
        return GenerateRequest(**fields)

    def _open_generation(self) -> None:
        template = self.template
        if template is None:
            return
        prompt = template.render(self.messages, add_generation_prompt=True)
        delta = template.delta(self._rendered, prompt, None, "the generation prompt")
        self._check(delta)
        self._rendered = prompt
        if delta.text:
            self._append("template", template.encode(delta.text), text=delta.text, exact=delta.exact, note=delta.note)

    def _close_generation(self, completion: Completion) -> tuple[str, Delta | None]:
        """Record the assistant message and return (its content, the template's closing text)."""
        template = self.template
        tokens = list(completion.token_ids)
        stop = (
            tokens[-1]
            if tokens
            and completion.finish_reason is FinishReason.STOP
            and isinstance(completion.stop_reason, int | None)
            else None
        )
        content_ids = tokens[:-1] if stop is not None else tokens
        if template is None:
            return (load_tokenizer(self.engine.config.tokenizer or self.engine.config.model).decode(tokens), None)
        content = template.decode(content_ids)
        message = {"role": "assistant", "content": content}
        after = template.render([*self.messages, message], add_generation_prompt=False)
        closing = template.delta(self._rendered + content, after, None, "closing the assistant turn")
        if closing.exact and stop is not None:
            stop_text = template.decode([stop])
            if closing.text.startswith(stop_text):  # the model wrote the end-of-turn marker itself
                closing = Delta(closing.text[len(stop_text) :])
            else:
                closing = Delta(
                    closing.text,
                    exact=False,
                    note=f"the model stopped with {stop_text!r}, which the template does not render after a turn",
                )
        self.messages.append(message)
        self._rendered = after
        return content, closing

    async def generate(self, sampling: SamplingParams | None = None, *, request_id: str | None = None) -> Turn:
        """Generate the next model turn from exactly the session's tokens; returns the turn
        (with parsed ``tool_calls`` when the session has a ``tool_parser``)."""
        self._open_generation()
        request = self._request(sampling, request_id)
        (completion,) = await self.engine.generate(request)
        content, closing = self._close_generation(completion)
        calls = None
        if self.tool_parser is not None:
            calls = await self.engine.parse_tool_calls(content, self.tool_parser, self.tools or ())
        turn = self._append(
            "model",
            completion.token_ids,
            role="assistant",
            text=content,
            completion=completion,
            tool_calls=calls,
        )
        if closing is not None and (closing.text or not closing.exact):
            assert self.template is not None
            self._append(
                "template",
                self.template.encode(closing.text),
                text=closing.text,
                exact=closing.exact,
                note=closing.note,
            )
            self._check(closing)
        return turn


def _twin_on_same_engine(session: Session, inner: AsyncSession) -> Session:
    return Session(session.engine, inner)


class Session(SyncTwin):
    """The synchronous twin of :class:`AsyncSession` (from ``Engine.session``), derived from it
    member by member (see :mod:`rlinfer_core.sync_twin`)."""

    def __init__(self, engine: Engine, inner: AsyncSession) -> None:
        self._engine = engine
        self.inner = inner

    @property
    def engine(self) -> Engine:
        """The synchronous engine the session runs on (``inner.engine`` is its async engine)."""
        return self._engine

    def _target(self) -> AsyncSession:
        return self.inner

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._engine._run(coro)

    def _iterate(self, iterator: AsyncIterator[Y]) -> Iterator[Y]:
        return self._engine._iterate(iterator)

    tools = Delegated[tuple[ToolSpec, ...] | None]()
    tool_parser = Delegated[str | None]()
    sampling = Delegated[SamplingParams]()
    strict = Delegated[bool]()
    lora = Delegated[str | None]()
    template = Delegated[ChatTemplate | None]()
    messages = Delegated[list[dict[str, Any]]]()
    turns = Delegated[list[Turn]]()
    token_ids = delegated_property(AsyncSession.token_ids)
    exact = delegated_property(AsyncSession.exact)
    result = delegated(AsyncSession.result)
    add_message = delegated(AsyncSession.add_message)
    add_tool_result = delegated(AsyncSession.add_tool_result)
    add_tokens = delegated(AsyncSession.add_tokens)
    add_text = delegated(AsyncSession.add_text)
    generate = blocking(AsyncSession.generate)
    fork = converted(AsyncSession.fork, _twin_on_same_engine)
