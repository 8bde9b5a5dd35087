"""Hypothesis strategies for the JSON schemas pydantic writes into the server's OpenAPI document.

A small converter for the subset those schemas use ($ref into components, anyOf, type / type lists, enum,
const, properties + required, items, additionalProperties, minimum / maximum). Each object sets its required
properties and up to MAX_OPTIONAL others, and numbers are small more often than not: a body that sets twenty
random fields is refused for the first bad one, and the fuzzer would never get past validation.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

MAX_ITEMS = 3
MAX_OPTIONAL = 3
_SCALARS = {
    "null": st.none(),
    "boolean": st.booleans(),
    "string": st.text(max_size=24),
}


def from_schema(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values that satisfy `schema` (with `#/components/schemas/...` references resolved in `components`)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return st.deferred(lambda: from_schema(components[name], components))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(option, components) for option in schema[key]])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, components) for k in kind])
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        small = st.integers(min_value=max(low if low is not None else 0, 0), max_value=min(high or 16, 16))
        return small | st.integers(min_value=low, max_value=high)
    if kind == "number":
        low, high = schema.get("minimum"), schema.get("maximum")
        small = st.floats(min_value=max(low if low is not None else 0.0, 0.0), max_value=min(high or 1.0, 1.0))
        return small | st.floats(min_value=low, max_value=high, allow_nan=False, allow_infinity=False)
    if kind == "array":
        items = from_schema(schema.get("items", {}), components)
        return st.lists(items, max_size=MAX_ITEMS)
    if kind == "object" or "properties" in schema:
        return _object(schema, components)
    if kind in _SCALARS:
        return _SCALARS[kind]
    return st.none() | st.booleans() | st.integers() | st.text(max_size=8)  # {}: anything


def _object(schema: dict[str, Any], components: dict[str, Any]) -> st.SearchStrategy[dict]:
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    fields = {name: from_schema(sub, components) for name, sub in properties.items()}
    if not properties:
        extra = schema.get("additionalProperties", {})
        values = from_schema(extra if isinstance(extra, dict) else {}, components)
        return st.dictionaries(st.text(max_size=8), values, max_size=MAX_ITEMS)
    optional = sorted(name for name in properties if name not in required)

    @st.composite
    def draw(draw_one: st.DrawFn) -> dict:
        names = [n for n in properties if n in required]
        if optional:
            names += draw_one(st.lists(st.sampled_from(optional), max_size=MAX_OPTIONAL, unique=True))
        return {name: draw_one(fields[name]) for name in names}

    return draw()
