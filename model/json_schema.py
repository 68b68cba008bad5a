"""JSON mode with a schema (OpenAI's ``response_format: {"type": "json_schema", ...}``).

``SchemaGrammar`` compiles a JSON schema into a byte-level pushdown automaton with the interface
of ``model.structured``'s JSON-object grammar, so ``JsonMasks`` masks tokens for it the same way:
every output is a prefix of a JSON text the schema accepts, and the request ends when it is whole.

The schema subset is what structured-output APIs ask for: ``type`` (one or a list), ``properties``
with ``required`` (only those keys, each at most once, in any order; ``}`` once the required ones
are there) and ``minProperties``/``maxProperties`` (how many of those keys), objects without
``properties`` (any keys, values per ``additionalProperties``),
``items``, ``enum``, ``const``, ``anyOf`` (options must differ in their first byte), and ``{}``
for any value. Annotations (``title``, ``description``, ``format``, ...) are ignored; a keyword
that would constrain the output in a way this grammar does not enforce (``pattern``,
``minLength``, ``$ref``, ...) is a ``SchemaError`` naming it, never silently dropped.

A state is ``(mode, arg, frames)``: ``frames`` holds the open containers, an object's as
``("o", node, keys seen, current key)``, an array's as ``("a", node)``, where ``node`` indexes the
compiled schema nodes. Like the JSON-object grammar: no whitespace before the value, runs of at
most ``MAX_WHITESPACE_RUN`` elsewhere, strings of whole UTF-8 characters.
"""

from __future__ import annotations

import json
from typing import Any

from model.structured import (
    MAX_WHITESPACE_RUN,
    NUMBER_END,
    NUMBER_STARTS,
    STRING_END,
    STRING_MODES,
    WHITESPACE,
    number_start,
    number_step,
    string_step,
)

__all__ = ["SchemaError", "SchemaGrammar"]

_STR = STRING_MODES[0]  # strings and numbers are read as in JSON mode (model.structured)
_VALUE, _OBJ_FIRST, _OBJ_KEY, _KEY, _COLON, _AFTER, _ARR_FIRST, _NUM, _ALT, _DONE = range(100, 110)
_QUOTE = ord('"')

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "format", "$schema", "$id", "$comment",
                         "deprecated", "readOnly", "writeOnly"})
KNOWN = frozenset({"type", "properties", "required", "additionalProperties", "items", "enum", "const", "anyOf",
                   "minProperties", "maxProperties", "$ref", "$defs", "definitions"})
_FIRST = {"object": b"{", "array": b"[", "string": b'"', "number": b"-0123456789", "integer": b"-0123456789",
          "boolean": b"tf", "null": b"n"}


MAX_DEPTH = 32  # nesting of schemas (properties, items, anyOf) a request may give
MAX_NODES = 4096  # compiled parts of one schema
MAX_REF_DEPTH = 4  # a recursive $ref is expanded this many times deep; deeper, any value goes


class SchemaError(ValueError):
    """A schema this grammar cannot enforce, or one past the complexity budget."""


class SchemaGrammar:
    def __init__(self, schema: dict[str, Any]) -> None:
        """``schema`` may use ``$ref`` to ``#`` or to its ``$defs``/``definitions`` (as Pydantic
        models' schemas do); a recursive one is expanded ``MAX_REF_DEPTH`` times."""
        self.nodes: list[dict[str, Any]] = [{"kind": "any"}]  # node 0: any JSON value
        self._root = schema
        self._expanding: dict[str, int] = {}  # $ref -> how many times it is being expanded now
        root = self._compile(schema, "$")
        if set(self._first_bytes(root)) & NUMBER_STARTS:
            raise SchemaError("$: a number at the top level never ends (nothing may follow it); give an object, "
                              "an array, a string or an enum of strings")
        self.start = (_VALUE, (root, MAX_WHITESPACE_RUN), ())  # the value starts the output

    # -- compiling ---------------------------------------------------------------------------
    def _add(self, node: dict[str, Any]) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"the schema has more than {MAX_NODES} parts; this server's limit")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _compile(self, schema: Any, where: str, depth: int = 0) -> int:
        if depth > MAX_DEPTH:
            raise SchemaError(f"{where}: schemas nested more than {MAX_DEPTH} deep exceed this server's limit")
        if schema is True or schema == {}:
            return 0
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object, got {schema!r}")
        unknown = sorted(set(schema) - KNOWN - ANNOTATIONS)
        if unknown:
            raise SchemaError(f"{where}: {unknown[0]!r} is not supported by this server's structured output")
        if "$ref" in schema:
            return self._ref(schema, where, depth)
        if "const" in schema or "enum" in schema:
            values = [schema["const"]] if "const" in schema else schema["enum"]
            if not isinstance(values, list) or not values or any(isinstance(v, dict | list) for v in values):
                raise SchemaError(f"{where}: enum/const must list strings, numbers, booleans or null")
            return self._add({"kind": "alt", "texts": tuple(json.dumps(v, ensure_ascii=False).encode() for v in values)})
        if "anyOf" in schema:
            if not isinstance(schema["anyOf"], list) or not schema["anyOf"]:
                raise SchemaError(f"{where}.anyOf: must be a non-empty list")
            return self._union([self._compile(s, f"{where}.anyOf[{i}]", depth + 1) for i, s in enumerate(schema["anyOf"])],
                               where)
        kind = schema.get("type")
        if kind is None:
            kind = "object" if "properties" in schema else "array" if "items" in schema else None
        if kind is None:
            return 0
        if isinstance(kind, list):
            return self._union([self._compile({**schema, "type": k}, where, depth) for k in kind], where)
        if kind == "object":
            return self._object(schema, where, depth)
        if kind == "array":
            return self._add({"kind": "array", "items": self._compile(schema.get("items", {}), f"{where}.items", depth + 1)})
        if kind not in _FIRST:
            raise SchemaError(f"{where}: unknown type {kind!r}")
        return self._add({"kind": kind})

    def _ref(self, schema: dict[str, Any], where: str, depth: int) -> int:
        ref = schema["$ref"]
        others = sorted(set(schema) - {"$ref", "$defs", "definitions"} - ANNOTATIONS)
        if others:
            raise SchemaError(f"{where}: {others[0]!r} beside $ref is not supported")
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith(("#/$defs/", "#/definitions/"))):
            raise SchemaError(f"{where}: $ref {ref!r} is not supported (only '#' and '#/$defs/NAME')")
        target: Any = self._root
        if ref != "#":
            section, name = ref[2:].split("/", 1)
            target = (self._root.get(section) or {}).get(name)
            if target is None:
                raise SchemaError(f"{where}: $ref {ref!r} names no definition")
        if self._expanding.get(ref, 0) >= MAX_REF_DEPTH:
            return 0  # a recursive schema this deep: any value
        self._expanding[ref] = self._expanding.get(ref, 0) + 1
        try:
            return self._compile(target, f"{where}->{ref}", depth + 1)
        finally:
            self._expanding[ref] -= 1

    def _object(self, schema: dict[str, Any], where: str, depth: int) -> int:
        extra = schema.get("additionalProperties", "properties" not in schema)
        if "properties" not in schema:  # any keys; their values per additionalProperties
            if "minProperties" in schema or "maxProperties" in schema:
                raise SchemaError(f"{where}: minProperties/maxProperties are supported only beside properties")
            values = 0 if extra is True else self._compile(extra, f"{where}.additionalProperties", depth + 1) if extra else None
            if values is None:
                raise SchemaError(f"{where}: an object with no properties and additionalProperties false is always {{}}")
            return self._add({"kind": "object", "props": None, "values": values, "required": frozenset()})
        if extra not in (False, None):
            raise SchemaError(f"{where}: additionalProperties beside properties is not supported (use false)")
        props = {}
        for name, sub in schema["properties"].items():
            if any(c in name for c in '"\\') or any(ord(c) < 0x20 for c in name):
                raise SchemaError(f"{where}: property name {name!r} needs escaping, which is not supported")
            props[name] = self._compile(sub, f"{where}.properties.{name}", depth + 1)
        required = frozenset(schema.get("required", ()))
        if not required <= set(props):
            raise SchemaError(f"{where}: required names {sorted(required - set(props))} that are not properties")
        least, most = schema.get("minProperties", 0), schema.get("maxProperties", len(props))
        for name, n in (("minProperties", least), ("maxProperties", most)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise SchemaError(f"{where}: {name} must be a non-negative integer, got {n!r}")
        if least > min(most, len(props)) or most < len(required):
            raise SchemaError(f"{where}: no object has {least}..{most} of its {len(props)} properties with the "
                              f"{len(required)} required ones")
        return self._add({"kind": "object", "props": props, "required": required, "min": least, "max": most})

    def _first_bytes(self, node: int) -> bytes:
        n = self.nodes[node]
        if n["kind"] == "any":
            return b'{["-0123456789tfn'
        if n["kind"] == "alt":
            return bytes({t[0] for t in n["texts"]})
        if n["kind"] == "union":
            return b"".join(self._first_bytes(o) for o in n["options"])
        return _FIRST[n["kind"]]

    def _union(self, options: list[int], where: str) -> int:
        seen: set[int] = set()
        for o in options:
            first = set(self._first_bytes(o))
            if first & seen:
                raise SchemaError(f"{where}: the options of anyOf/type must start differently (an object, a string, "
                                  "a number, ...), these overlap")
            seen |= first
        return self._add({"kind": "union", "options": tuple(options)})

    # -- the automaton ------------------------------------------------------------------------
    def done(self, state) -> bool:
        return state is not None and state[0] == _DONE

    def cache_key(self, state, depth: int):
        return state

    def in_free_string(self, state) -> bool:
        """Inside a string that any plain text continues (a key of a known object is not)."""
        return state[0] == _STR and state[1][1] == 0

    def _complete(self, frames: tuple):
        """The state after a value that just ended."""
        if not frames:
            return (_DONE, None, ())
        top = frames[-1]
        if top[0] == "o":  # a known key is seen now (an object with any keys keeps no keys)
            seen = top[2] + (top[3],) if isinstance(top[3], str) else top[2]
            frames = (*frames[:-1], ("o", top[1], seen, None))
        return (_AFTER, 0, frames)

    def _value(self, node: int, b: int, frames: tuple):
        """The first byte of a value of ``node``."""
        n = self.nodes[node]
        kind = n["kind"]
        if kind == "union":
            for option in n["options"]:
                got = self._value(option, b, frames)
                if got is not None:
                    return got
            return None
        if kind == "alt":
            rest = tuple(t[1:] for t in n["texts"] if t[0] == b)
            return self._alt(rest, frames) if rest else None
        if b == ord("{") and kind in ("object", "any"):
            return (_OBJ_FIRST, 0, (*frames, ("o", node, (), None)))
        if b == ord("[") and kind in ("array", "any"):
            return (_ARR_FIRST, 0, (*frames, ("a", node)))
        if b == _QUOTE and kind in ("string", "any"):
            return (_STR, (False, 0), frames)
        if kind in ("number", "integer", "any") and b in NUMBER_STARTS:
            return (_NUM, (number_start(b), kind == "integer"), frames)
        if kind in ("boolean", "any") and b in b"tf":
            return self._alt((b"rue",) if b == ord("t") else (b"alse",), frames)
        if kind in ("null", "any") and b == ord("n"):
            return self._alt((b"ull",), frames)
        return None

    def _alt(self, rest: tuple[bytes, ...], frames: tuple):
        return self._complete(frames) if all(not r for r in rest) else (_ALT, rest, frames)

    def _keys_left(self, frame) -> list[str] | None:
        """The keys an object may still take (None: any)."""
        node = self.nodes[frame[1]] if frame[1] else {}
        if node.get("props") is None:
            return None
        left = [k for k in node["props"] if k not in frame[2]]
        missing = [k for k in left if k in node["required"]]
        # the keys still allowed leave room for the required ones: past that, only those
        return missing if node["max"] - len(frame[2]) <= len(missing) else left

    def _may_close(self, frame) -> bool:
        node = self.nodes[frame[1]]
        return frame[1] == 0 or (node["required"] <= set(frame[2]) and len(frame[2]) >= node.get("min", 0))

    def _value_node(self, frame) -> int:
        """The schema of the value after the current key (objects) or of the items (arrays)."""
        node = self.nodes[frame[1]]
        if frame[1] == 0:
            return 0
        if frame[0] == "a":
            return node["items"]
        return node["values"] if node["props"] is None else node["props"][frame[3]]

    def step(self, state, b: int):
        mode, arg, frames = state
        if mode in STRING_MODES:
            nxt = string_step(mode, arg, b)
            if nxt is not STRING_END:
                return None if nxt is None else (*nxt, frames)
            if arg[0]:  # a key of an object with any keys: its text is not kept
                top = frames[-1]
                return (_COLON, 0, (*frames[:-1], ("o", top[1], top[2], 0)))
            return self._complete(frames)
        if mode == _KEY:  # a key of an object with known properties: arg is the text so far
            top = frames[-1]
            names = self._keys_left(top)
            if b == _QUOTE:
                name = arg.decode("utf-8", errors="replace")
                return (_COLON, 0, (*frames[:-1], ("o", top[1], top[2], name))) if name in names else None
            typed = arg + bytes([b])
            return (_KEY, typed, frames) if any(n.encode().startswith(typed) for n in names) else None
        if mode == _ALT:
            rest = tuple(r[1:] for r in arg if r and r[0] == b)
            if rest:
                return self._alt(rest, frames)
            return self.step(self._complete(frames), b) if b"" in arg else None
        if mode == _NUM:
            place, integer = arg
            nxt = number_step(place, b, integer)
            if nxt is NUMBER_END:
                return self.step(self._complete(frames), b)
            return None if nxt is None else (_NUM, (nxt, integer), frames)
        if mode == _DONE:
            return None
        ws = arg[1] if mode == _VALUE else arg
        if b in WHITESPACE:
            if ws >= MAX_WHITESPACE_RUN:
                return None
            return (mode, (arg[0], ws + 1) if mode == _VALUE else ws + 1, frames)
        if mode == _VALUE:
            return self._value(arg[0], b, frames)
        top = frames[-1]
        if mode in (_OBJ_FIRST, _OBJ_KEY):
            if b == _QUOTE:
                names = self._keys_left(top)
                return (_STR, (True, 0), frames) if names is None else (_KEY, b"", frames) if names else None
            if b == ord("}") and mode == _OBJ_FIRST and self._may_close(top):
                return self._complete(frames[:-1])
            return None
        if mode == _COLON:
            return (_VALUE, (self._value_node(top), 0), frames) if b == ord(":") else None
        if mode == _ARR_FIRST:
            if b == ord("]"):
                return self._complete(frames[:-1])
            return self._value(self._value_node(top), b, frames)
        # _AFTER: a value ended inside the innermost container
        if top[0] == "o":
            left = self._keys_left(top)
            if b == ord(",") and (left is None or left):
                return (_OBJ_KEY, 0, frames)
            if b == ord("}") and self._may_close(top):
                return self._complete(frames[:-1])
            return None
        if b == ord(","):
            return (_VALUE, (self._value_node(top), 0), frames)
        return self._complete(frames[:-1]) if b == ord("]") else None
