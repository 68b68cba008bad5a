"""What a request's structured output compiles to (``model.grammar.GrammarSpec``): OpenAI's
``response_format``, vLLM's ``structured_outputs`` (and its older ``guided_*`` fields), a
named function's arguments and ``tool_choice`` required; a 400 naming what this server cannot
enforce or what is over ``limits.max_grammar_bytes``."""

from __future__ import annotations

import json
from typing import Any

from deploy.errors import APIError
from model.grammar import GrammarError, GrammarSpec

__all__ = ["MAX_JSON_NESTING", "checked", "forced_grammar", "grammar", "nesting", "required_grammar", "schema_spec"]

MAX_JSON_NESTING = 128  # objects and arrays inside each other in a tool's parameters


def nesting(value: Any) -> int:
    """How deep objects and arrays nest in a JSON value (without recursion: a hostile value
    may nest thousands deep)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_NESTING:
            stack.extend((c, depth + 1) for c in children)
    return deepest

def rerooted(schema: dict, prefix: str) -> tuple[dict, dict]:
    """``schema`` made a part of another one: (the schema, its definitions under names that
    start with ``prefix``), its ``$ref``s (to ``#`` or its own ``$defs``/``definitions``) pointing
    there."""
    own = {**(schema.get("definitions") or {}), **(schema.get("$defs") or {})}
    to_root = False  # a $ref to "#": the schema itself becomes a definition

    def move(node: Any) -> Any:
        nonlocal to_root
        if isinstance(node, list):
            return [move(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {k: move(v) for k, v in node.items() if k not in ("$defs", "definitions")}
        ref = node.get("$ref")
        if ref == "#":
            out["$ref"], to_root = f"#/$defs/{prefix}", True
        elif isinstance(ref, str) and ref.startswith(("#/$defs/", "#/definitions/")):
            out["$ref"] = f"#/$defs/{prefix}{ref.split('/', 2)[2]}"
        return out

    defs = {f"{prefix}{name}": move(sub) for name, sub in own.items()}
    moved = move(schema)
    if to_root:
        defs[prefix] = moved
    return moved, defs


def checked(spec: GrammarSpec, param: str, max_bytes: int) -> GrammarSpec:
    """``spec`` if this server can enforce it within ``max_bytes`` (``Limits.max_grammar_bytes``),
    else a 400 naming what it cannot."""
    if spec.size > max_bytes:
        raise APIError(400, f"{param}: the grammar is {spec.size} bytes, over the limit of {max_bytes} "
                            "(limits.max_grammar_bytes)", param=param, code="unsupported_schema")
    try:
        spec.check()
    except GrammarError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="unsupported_schema") from None
    return spec


def schema_spec(schema: dict, param: str, max_bytes: int, any_whitespace: bool = False) -> GrammarSpec:
    """A JSON schema this server can enforce, as its grammar (a 400 naming what it cannot)."""
    if nesting(schema) > MAX_JSON_NESTING:
        raise APIError(400, f"{param}: the schema nests more than {MAX_JSON_NESTING} objects and arrays deep",
                       param=param, code="unsupported_schema")
    text = json.dumps(schema, ensure_ascii=False)  # property order is the output's order
    return checked(GrammarSpec("json_schema", text, any_whitespace=any_whitespace), param, max_bytes)


def grammar(body, max_bytes: int, any_whitespace: bool = False) -> GrammarSpec | None:
    """What the output must match, from ``response_format`` or vLLM's structured outputs
    (None: free text); a 400 for one this server cannot enforce or over ``max_bytes``.
    ``any_whitespace``: the server's default for JSON (a request's
    ``structured_outputs.disable_any_whitespace`` decides for itself)."""
    fmt = body.response_format or {}
    kind = fmt.get("type", "text")
    vllm = _structured_outputs(body, max_bytes, any_whitespace)
    if vllm is not None:
        if kind != "text":
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        return vllm
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", any_whitespace=any_whitespace)
    if kind != "json_schema":
        raise APIError(400, f"response_format {kind!r} is not supported by this server (text, json_object or "
                       "json_schema)", param="response_format", code="unsupported_parameter")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise APIError(400, "response_format json_schema needs json_schema: {name, schema}", param="response_format")
    return schema_spec(spec.get("schema", {}), "response_format", max_bytes, any_whitespace)

def _structured_outputs(body, max_bytes: int, any_whitespace: bool) -> GrammarSpec | None:
    """vLLM's ``structured_outputs`` (or its older ``guided_*`` fields): one of json,
    json_object, choice, regex and grammar; ``disable_any_whitespace`` decides the whitespace."""
    options = dict(body.structured_outputs or {})
    if "disable_any_whitespace" in options:
        any_whitespace = not options.pop("disable_any_whitespace")
    given = {k: v for k, v in options.items() if v is not None and v is not False}
    guided = {"json": body.guided_json, "choice": body.guided_choice, "regex": body.guided_regex,
              "grammar": body.guided_grammar}
    given |= {k: v for k, v in guided.items() if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"structured outputs take one of json, json_object, choice, regex and grammar, got "
                            f"{sorted(given)}", param="structured_outputs")
    (kind, value), = given.items()
    build = _STRUCTURED.get(kind)
    if build is None:
        raise APIError(400, f"structured_outputs {kind!r} is not supported by this server (json, json_object, "
                       "choice, regex, grammar)", param="structured_outputs", code="unsupported_parameter")
    return build(kind, value, max_bytes, any_whitespace)


def _json(kind: str, value: Any, max_bytes: int, any_whitespace: bool) -> GrammarSpec:
    try:
        schema = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        raise APIError(400, "structured_outputs json: not a JSON schema", param="structured_outputs") from None
    if not isinstance(schema, dict):
        raise APIError(400, "structured_outputs json: a schema is an object", param="structured_outputs")
    return schema_spec(schema, "structured_outputs", max_bytes, any_whitespace)


def _choice(kind: str, value: Any, max_bytes: int, any_whitespace: bool) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise APIError(400, "structured_outputs choice: a list of texts", param="structured_outputs")
    return checked(GrammarSpec("choice", choices=tuple(value)), "structured_outputs choice", max_bytes)


def _text_grammar(kind: str, value: Any, max_bytes: int, any_whitespace: bool) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise APIError(400, f"structured_outputs {kind}: a non-empty text", param="structured_outputs")
    return checked(GrammarSpec(kind, value), f"structured_outputs {kind}", max_bytes)


_STRUCTURED = {
    "json": _json, "choice": _choice, "regex": _text_grammar, "grammar": _text_grammar,
    "json_object": lambda kind, value, max_bytes, any_ws: GrammarSpec("json_object", any_whitespace=any_ws),
}


def forced_grammar(body, name: str, max_bytes: int, any_whitespace: bool = False) -> GrammarSpec:
    """The named function's arguments: per its parameters schema where it has one this
    server can enforce, else any JSON object."""
    fn = next(t["function"] for t in body.tools or [] if t["function"]["name"] == name)
    params = fn.get("parameters")
    if isinstance(params, dict) and params:
        try:
            return schema_spec(params, "tools", max_bytes, any_whitespace)
        except APIError:
            pass  # a schema it cannot enforce: the arguments are still one JSON object
    return GrammarSpec("json_object", any_whitespace=any_whitespace)

def required_grammar(body, max_bytes: int, any_whitespace: bool = False) -> GrammarSpec | None:
    """With ``tool_choice`` required: the one call the output is, ``{NAME: ARGUMENTS}`` with
    one of the tools' names, each tool's arguments per its parameters (any JSON object
    where it has none, or one this server cannot enforce); None otherwise."""
    if body.tool_choice != "required":
        return None
    tools = body.tool_functions()
    if not tools:
        raise APIError(400, "tool_choice required needs tools", param="tool_choice")
    calls: list[dict[str, Any]] = []
    all_defs: dict[str, Any] = {}
    for tool in tools:
        name, params = tool["function"]["name"], tool["function"].get("parameters")
        params = params if isinstance(params, dict) and params else {"type": "object"}
        moved, defs = rerooted(params, f"{name}.")
        try:
            schema_spec({**moved, "$defs": defs}, "tools", max_bytes)
        except APIError:  # a schema it cannot enforce: the arguments are still one JSON object
            moved, defs = {"type": "object"}, {}
        calls.append({"type": "object", "properties": {name: moved}, "required": [name],
                      "additionalProperties": False})
        all_defs.update(defs)
    return schema_spec({"anyOf": calls, "$defs": all_defs}, "tools", max_bytes, any_whitespace)
