"""``response_format`` and vLLM's ``structured_outputs`` -> rlinfer's StructuredOutput.

Honoured: ``response_format`` ``text`` (no constraint), ``json_object`` (one JSON object),
``json_schema`` (its ``schema``); ``structured_outputs`` with one of ``json`` (a schema),
``json_object``, ``regex``, ``choice``, ``grammar`` (EBNF in the GBNF dialect both engines' xgrammar
reads; capability ``generate.grammar_ebnf`` too). The engines enforce them with their grammar
backends (capability ``generate.structured``). Refused with a 400 naming the field: structural
tags (no engine-neutral form), more than one constraint, and the whitespace options (rlinfer's
engines always generate compact JSON).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlinfer_core.errors import InvalidRequest
from rlinfer_core.structured import StructuredOutput
from rlinfer_server.schemas import ResponseFormat, StructuredOutputsIn

#: what ``json_object`` means: any JSON object
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def renamed(exc: InvalidRequest, field: str) -> InvalidRequest:
    """The same problem, naming the request's ``field`` instead of the core's."""
    message = str(exc)
    prefix = f"invalid {exc.field}: "
    return InvalidRequest(field, message[len(prefix) :] if message.startswith(prefix) else message)


def _from_response_format(fmt: ResponseFormat) -> StructuredOutput | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput.json(JSON_OBJECT_SCHEMA)
    if fmt.type == "structural_tag":
        raise InvalidRequest("response_format", "structural tags are not supported by rlinfer serve")
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise InvalidRequest("response_format.json_schema", "type 'json_schema' needs json_schema.schema")
    schema = fmt.json_schema.json_schema
    try:
        return StructuredOutput.json(schema)
    except InvalidRequest as exc:
        raise renamed(exc, "response_format.json_schema.schema") from None


def _from_structured_outputs(so: StructuredOutputsIn) -> StructuredOutput:
    if so.whitespace_pattern is not None or so.disable_additional_properties:
        field = "whitespace_pattern" if so.whitespace_pattern is not None else "disable_additional_properties"
        raise InvalidRequest(f"structured_outputs.{field}", "is not supported (JSON is generated compact)")
    if so.structural_tag is not None:
        raise InvalidRequest(
            "structured_outputs.structural_tag", "is not supported: each engine's structural tags differ"
        )
    given: dict[str, Callable[[], StructuredOutput]] = {}
    if so.json_ is not None:
        schema = so.json_
        given["json"] = lambda: StructuredOutput.json(schema)
    if so.json_object:
        given["json_object"] = lambda: StructuredOutput.json(JSON_OBJECT_SCHEMA)
    if so.regex is not None:
        pattern = so.regex
        given["regex"] = lambda: StructuredOutput.regex(pattern)
    if so.choice is not None:
        options = so.choice
        given["choice"] = lambda: StructuredOutput.choices(options)
    if so.grammar is not None:
        grammar = so.grammar
        given["grammar"] = lambda: StructuredOutput.ebnf(grammar)
    if len(given) != 1:
        raise InvalidRequest(
            "structured_outputs",
            f"give exactly one of json, json_object, regex, choice, grammar; got {sorted(given) or 'none'}",
        )
    ((kind, build),) = given.items()
    try:
        return build()
    except InvalidRequest as exc:
        raise renamed(exc, f"structured_outputs.{kind}") from None


def structured_constraint(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsIn | None
) -> StructuredOutput | None:
    """The one constraint of a request (``response_format`` overrides ``structured_outputs``, as
    in vLLM), or None."""
    from_format = _from_response_format(response_format) if response_format is not None else None
    if from_format is not None:
        return from_format
    return _from_structured_outputs(structured_outputs) if structured_outputs is not None else None
