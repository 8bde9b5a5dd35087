"""An EBNF grammar (for xgrammar) of Gemma 4 tool calls whose arguments follow the tools' JSON schemas.

`tool_choice: "required"` or a named function constrains the reply to calls, so even a model that would not
call a tool writes a valid one:

    root ::= call+                                  (one call if single: a named function, no parallel calls)
    call ::= "<|tool_call>call:" (fn0 | fn1) "<tool_call|>"
    fn0  ::= "get_weather{" ... "}"                 keys bare and sorted, as the chat template writes them

Values are Gemma's notation (gemma4_values): strings between <|"|> tokens (without '<', so no control token
can hide inside one), integers and numbers of bounded length, true / false / null, arrays and nested
objects. Supported schema words: type (one or a list), properties, required, items, enum, const, anyOf /
oneOf, maxLength, minItems / maxItems, integer minimum / maximum over small ranges; anything else allows any
value. Properties come in sorted order; optional ones may be left out.
"""

from __future__ import annotations

import json
from typing import Any

_STRING_CHARS = "[^<]"
_ANY_VALUE = "any_value"
_GENERIC_RULES = r"""
any_value ::= any_string | any_number | "true" | "false" | "null" | any_object | any_array
any_string ::= "<|\"|>" [^<]* "<|\"|>"
any_number ::= "-"? ("0" | [1-9] [0-9]{0,17}) ("." [0-9]{1,16})?
any_object ::= "{" (any_key ":" any_value ("," any_key ":" any_value)*)? "}"
any_key ::= [a-zA-Z_] [a-zA-Z0-9_]{0,63}
any_array ::= "[" (any_value ("," any_value)*)? "]"
"""
_SMALL_RANGE = 256  # integer ranges up to this many values are listed one by one


def _literal(text: str) -> str:
    return json.dumps(text)  # an EBNF string literal (xgrammar takes JSON-style escapes)


def _gemma_literal(value: Any) -> str:
    """How the model writes a constant (enum / const) value."""
    if isinstance(value, str):
        return _literal('<|"|>' + value + '<|"|>')
    if isinstance(value, bool):
        return _literal("true" if value else "false")
    if value is None:
        return _literal("null")
    return _literal(json.dumps(value))


class _Rules:
    def __init__(self) -> None:
        self.rules: list[str] = []

    def add(self, name: str, body: str) -> str:
        self.rules.append(f"{name} ::= {body}")
        return name

    def value(self, schema: Any, name: str) -> str:
        """An expression matching one value of `schema` (rules it needs are added under `name`_...)."""
        if not isinstance(schema, dict):
            return _ANY_VALUE
        if "const" in schema:
            return _gemma_literal(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(_gemma_literal(v) for v in schema["enum"]) + ")"
        for word in ("anyOf", "oneOf"):
            if isinstance(schema.get(word), list) and schema[word]:
                options = [self.value(sub, f"{name}_{i}") for i, sub in enumerate(schema[word])]
                return "(" + " | ".join(options) + ")"
        kind = schema.get("type")
        if isinstance(kind, list):
            options = [self.value({**schema, "type": k}, f"{name}_{k}") for k in kind]
            return "(" + " | ".join(options) + ")" if options else _ANY_VALUE
        if kind == "string":
            return self._string(schema)
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return '("-"? ("0" | [1-9] [0-9]{0,17}) ("." [0-9]{1,16})?)'
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self._array(schema, name)
        if kind == "object" or "properties" in schema:
            return self.add(name, self.object_body(schema, name, braces=True))
        return _ANY_VALUE

    def _string(self, schema: dict) -> str:
        low = schema.get("minLength", 0)
        high = schema.get("maxLength")
        if isinstance(high, int) and isinstance(low, int):
            chars = f"{_STRING_CHARS}{{{low},{high}}}"
        elif isinstance(low, int) and low > 0:
            chars = f"{_STRING_CHARS}{{{low},}}"
        else:
            chars = f"{_STRING_CHARS}*"
        return f'("<|\\"|>" {chars} "<|\\"|>")'

    def _integer(self, schema: dict) -> str:
        low, high = schema.get("minimum"), schema.get("maximum")
        if isinstance(low, int) and isinstance(high, int) and 0 <= high - low < _SMALL_RANGE:
            return "(" + " | ".join(_literal(str(v)) for v in range(low, high + 1)) + ")"
        sign = "" if isinstance(low, int) and low >= 0 else '"-"? '
        return f'({sign}("0" | [1-9] [0-9]{{0,17}}))'

    def _array(self, schema: dict, name: str) -> str:
        item = self.value(schema.get("items"), f"{name}_item")
        low = max(int(schema.get("minItems", 0)), 0)
        high = schema.get("maxItems")
        more = f'("," {item})'
        if isinstance(high, int):
            if high == 0:
                return '("[" "]")'
            rest = f"{more}{{{max(low - 1, 0)},{high - 1}}}"
        else:
            rest = f"{more}{{{max(low - 1, 0)},}}" if low > 1 else f"{more}*"
        items = f"{item} {rest}"
        return f'("[" {items} "]")' if low > 0 else f'("[" ({items})? "]")'

    def object_body(self, schema: dict, name: str, braces: bool) -> str:
        """`{key:value,...}` of an object schema: sorted keys, required ones always, optional ones maybe."""
        properties = schema.get("properties")
        if properties == {}:
            return '("{" "}")' if braces else '""'  # declared without parameters
        if not isinstance(properties, dict):
            return "any_object" if braces else '(any_key ":" any_value ("," any_key ":" any_value)*)?'
        required = set(schema.get("required") or ())
        keys = sorted(properties)
        pairs = [f"{_literal(key + ':')} {self.value(properties[key], f'{name}_{i}')}" for i, key in enumerate(keys)]
        # first_i: nothing written yet, keys i.. to go; rest_i: something written, keys i.. to go (a comma first)
        first, rest = '""', '""'
        for i in reversed(range(len(keys))):
            pair = pairs[i]
            if keys[i] in required:
                new_rest = f'"," {pair} {rest}'
                new_first = f"{pair} {rest}"
            else:
                new_rest = f'("," {pair})? {rest}'
                new_first = f"({pair} {rest} | {first})"
            rest = self.add(f"{name}_rest{i}", new_rest)
            first = self.add(f"{name}_first{i}", new_first)
        return f'"{{" {first} "}}"' if braces else first


def tool_call_grammar(tools: list[dict], forced: str | None, single: bool) -> str:
    """EBNF of calls of `tools` (OpenAI function tools), or of `forced` alone: exactly one call if `single`,
    else one or more."""
    rules = _Rules()
    functions = []
    for i, tool in enumerate(tools):
        function = tool["function"]
        if forced is not None and function["name"] != forced:
            continue
        parameters = function.get("parameters") or {}
        args = rules.object_body(parameters, f"fn{i}_args", braces=False)
        functions.append(rules.add(f"fn{i}", f'{_literal(function["name"] + "{")} {args} "}}"'))
    call = rules.add("call", f'"<|tool_call>call:" ({" | ".join(functions)}) "<tool_call|>"')
    rules.add("root", call if single else f"{call}+")
    return "\n".join(rules.rules) + "\n" + _GENERIC_RULES
