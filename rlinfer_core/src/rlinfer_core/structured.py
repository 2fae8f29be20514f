"""Structured-output constraints (capability ``generate.structured``): JSON schema, regex, choice,
and EBNF grammars (capability ``generate.grammar_ebnf`` as well).

A constraint is set on :attr:`rlinfer_core.types.SamplingParams.structured` and validated where it
is built, so an invalid JSON schema or regex is an :class:`~rlinfer_core.errors.InvalidRequest`
naming the field (``structured.json_schema``, ``structured.regex``, ``structured.choice``,
``structured.ebnf``) and
never reaches an engine. The engines enforce it with their own grammar backends (xgrammar, or what
each engine uses); the kit checks that every output parses / matches.

Logprobs under a constraint (both backends): ``logprobs_mode="processed"`` includes the grammar
mask (tokens the grammar forbids at a step have probability 0 and the rest is renormalised, like
``allowed_token_ids``); ``logprobs_mode="raw"`` is ``log_softmax`` of the model's own logits,
unaffected by the grammar.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from rlinfer_core.errors import InvalidRequest

FIELD = "structured"


class StructuredKind(enum.StrEnum):
    """Which kind of constraint."""

    JSON_SCHEMA = "json_schema"  #: the output is one JSON document valid under the schema
    REGEX = "regex"  #: the output matches the regular expression in full
    CHOICE = "choice"  #: the output is exactly one of the given strings
    #: the output is a sentence of the EBNF grammar (GBNF dialect: ``root ::= "yes" | "no"``)
    EBNF = "ebnf"


def check_json_schema(schema: Any, field: str = f"{FIELD}.json_schema") -> Mapping[str, Any] | bool:
    """Raise InvalidRequest (naming ``field``) unless ``schema`` is a valid JSON Schema (checked
    against its draft's meta-schema, Draft 2020-12 when ``$schema`` is absent)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(field, f"must be a JSON schema (a dict or its JSON text): {exc}") from None
    if not isinstance(schema, Mapping | bool):
        raise InvalidRequest(field, f"must be a JSON schema object, got {type(schema).__name__}")
    import jsonschema  # type: ignore[import-untyped]
    import jsonschema.exceptions  # type: ignore[import-untyped]

    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InvalidRequest(field, f"is not a valid JSON schema at {where}: {exc.message}") from None
    try:
        json.dumps(schema)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(field, f"must be JSON-serialisable: {exc}") from None
    return schema


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _freeze(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_freeze(v) for v in value]
    return value


def _to_kind(value: Any) -> StructuredKind:
    try:
        return StructuredKind(value)
    except ValueError:
        raise InvalidRequest(FIELD, f"kind must be one of {[k.value for k in StructuredKind]}, got {value!r}") from None


@attrs.frozen
class StructuredOutput:
    """One constraint on the generated text. Build it with :meth:`json`, :meth:`regex`,
    :meth:`choices` or :meth:`ebnf`, or pass ``{"json_schema": ...}`` / ``{"regex": ...}`` /
    ``{"choice": [...]}`` / ``{"ebnf": ...}`` to ``SamplingParams(structured=...)``.

    ``value``: the JSON schema (a dict, or True for any JSON), the regex (Python ``re`` syntax
    restricted to what grammar engines accept: no look-around, no back-references), the
    tuple of choices, or the EBNF grammar text (the GBNF dialect both engines' xgrammar reads,
    starting at the rule ``root``; the engine compiles it, and a grammar it cannot compile is an
    InvalidRequest).
    """

    kind: StructuredKind = attrs.field(converter=_to_kind)
    value: Any = attrs.field(eq=False)
    #: canonical JSON of ``value`` (what equality and hashing use)
    key: str = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.kind is StructuredKind.JSON_SCHEMA:
            object.__setattr__(self, "value", _freeze(check_json_schema(self.value)))
        elif self.kind is StructuredKind.REGEX:
            object.__setattr__(self, "value", check_regex(self.value))
        elif self.kind is StructuredKind.EBNF:
            object.__setattr__(self, "value", check_ebnf(self.value))
        else:
            object.__setattr__(self, "value", check_choices(self.value))
        object.__setattr__(self, "key", json.dumps(self.value, sort_keys=True))

    @classmethod
    def json(cls, schema: Mapping[str, Any] | bool | str) -> StructuredOutput:
        """Output one JSON document valid under ``schema``."""
        return cls(StructuredKind.JSON_SCHEMA, schema)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Output text matching ``pattern`` in full."""
        return cls(StructuredKind.REGEX, pattern)

    @classmethod
    def choices(cls, options: Sequence[str]) -> StructuredOutput:
        """Output exactly one of ``options``."""
        return cls(StructuredKind.CHOICE, tuple(options))

    @classmethod
    def ebnf(cls, grammar: str) -> StructuredOutput:
        """Output a sentence of the EBNF ``grammar`` (rule ``root`` first: ``root ::= "yes" | "no"``)."""
        return cls(StructuredKind.EBNF, grammar)

    @property
    def schema_json(self) -> str:
        """The JSON schema as JSON text (for engines that take a string)."""
        return json.dumps(self.value)

    def accepts(self, text: str) -> bool:
        """True when ``text`` satisfies the constraint (the kit's check; for JSON schema it
        parses ``text`` and validates it with jsonschema; for EBNF it runs xgrammar's matcher, which
        both engines install)."""
        if self.kind is StructuredKind.CHOICE:
            return text in self.value
        if self.kind is StructuredKind.EBNF:
            from xgrammar.testing import _is_grammar_accept_string  # type: ignore[import-not-found]

            return bool(_is_grammar_accept_string(self.value, text))
        if self.kind is StructuredKind.REGEX:
            return re.fullmatch(self.value, text) is not None
        import jsonschema

        try:
            document = json.loads(text)
        except ValueError:
            return False
        validator = jsonschema.validators.validator_for(self.value, default=jsonschema.Draft202012Validator)
        return bool(validator(self.value).is_valid(document))


def check_regex(pattern: Any) -> str:
    """Raise InvalidRequest naming ``structured.regex`` unless ``pattern`` compiles and uses no
    construct that grammar engines reject (look-around, back-references)."""
    field = f"{FIELD}.regex"
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequest(field, f"must be a non-empty string, got {pattern!r}")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise InvalidRequest(field, f"does not compile: {exc}") from None
    for construct in ("(?=", "(?!", "(?<=", "(?<!", "(?P="):
        if construct in pattern:
            raise InvalidRequest(
                field, f"{construct!r}: look-around and back-references are not supported by grammar engines"
            )
    if re.search(r"(?<!\\)\\[1-9]", pattern):
        raise InvalidRequest(field, "back-references are not supported by grammar engines")
    return pattern


def check_ebnf(grammar: Any) -> str:
    """Raise InvalidRequest naming ``structured.ebnf`` unless ``grammar`` is a non-empty string
    that defines the rule ``root`` (where generation starts). The rest is checked by the engine's
    grammar compiler."""
    field = f"{FIELD}.ebnf"
    if not isinstance(grammar, str) or not grammar.strip():
        raise InvalidRequest(field, f"must be a non-empty EBNF grammar string, got {grammar!r}")
    if re.search(r"(?m)^\s*root\s*::=", grammar) is None:
        raise InvalidRequest(field, 'must define the rule \'root\' (e.g. root ::= "yes" | "no")')
    return grammar


def check_choices(options: Any) -> tuple[str, ...]:
    """Raise InvalidRequest naming ``structured.choice`` unless ``options`` is a non-empty
    sequence of distinct non-empty strings."""
    field = f"{FIELD}.choice"
    if isinstance(options, str | bytes) or not isinstance(options, Sequence):
        raise InvalidRequest(field, f"must be a list of strings, got {options!r}")
    out = tuple(options)
    if not out:
        raise InvalidRequest(field, "must hold at least one string")
    for i, item in enumerate(out):
        if not isinstance(item, str) or not item:
            raise InvalidRequest(field, f"item {i} must be a non-empty string, got {item!r}")
    if len(set(out)) != len(out):
        raise InvalidRequest(field, "choices must be distinct")
    return out


def to_structured(value: Any) -> StructuredOutput | None:
    """Converter for ``SamplingParams.structured``: None, a StructuredOutput, or a one-key
    mapping ``{"json_schema" | "regex" | "choice" | "ebnf": value}``."""
    if value is None or isinstance(value, StructuredOutput):
        return value
    if isinstance(value, Mapping) and len(value) == 1:
        ((kind, inner),) = value.items()
        return StructuredOutput(kind, inner)
    raise InvalidRequest(
        FIELD, f"must be a StructuredOutput or one of {{'json_schema'|'regex'|'choice'|'ebnf': ...}}, got {value!r}"
    )
