"""JSON schemas as harmony writes them: the TypeScript-like types of a tool's parameters.

gpt-oss was trained on tools described as ``type NAME = (_: {...}) => any;`` inside a
``namespace``; this module writes the part between the parentheses, rule for rule as
openai-harmony's renderer does (``json_schema_to_typescript`` in its ``src/encoding.rs``):
objects list their properties one a line (``?`` when not required), with their
``title``, ``description`` and ``examples`` as ``//`` comments above and a ``default``
after; ``oneOf`` is a ``|`` list, one variant a line; enums of strings are unions of
literals; ``integer`` is ``number``; ``nullable`` adds ``| null``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def _is_enum(schema: Mapping[str, Any]) -> bool:
    values = schema.get("enum")
    return isinstance(values, list) and bool(values)


def _default(schema: Mapping[str, Any], value: Any, enum_bare: bool = True) -> str:
    """A default as harmony writes it: a string quoted as written, but bare when the
    schema is an enum (``enum_bare``; a top-level ``oneOf`` variant's is JSON instead)."""
    if isinstance(value, str) and not _is_enum(schema):
        return f'"{value}"'
    if isinstance(value, str) and enum_bare:
        return value
    return _json(value)


def _json(value: Any) -> str:
    # serde_json's compact form (what harmony's `{default}` prints)
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _nullable(variant: Any, text: str) -> str:
    if isinstance(variant, Mapping) and variant.get("nullable") is True and "null" not in text:
        return f"{text} | null"
    return text


def to_typescript(schema: Any, indent: str = "") -> str:
    """The type of ``schema`` (a JSON schema object), ``indent`` before its inner lines."""
    if not isinstance(schema, Mapping):
        return "any"
    one_of = schema.get("oneOf")
    if isinstance(one_of, list):
        return _top_one_of(one_of, indent)
    kind = schema.get("type")
    if isinstance(kind, list):
        names = ["number" if t == "integer" else t for t in kind if isinstance(t, str)]
        if names:
            return " | ".join(names)
    if not isinstance(kind, str):
        return "any"
    if kind == "object":
        return _object(schema, indent)
    if kind == "string":
        values = schema.get("enum")
        literals = (
            [f'"{v}"' for v in values if isinstance(v, str)] if isinstance(values, list) else []
        )
        return " | ".join(literals) if literals else "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "array":
        items = schema.get("items")
        return f"{to_typescript(items, indent)}[]" if items is not None else "Array<any>"
    return "any"


def _top_one_of(variants: list[Any], indent: str) -> str:
    """A schema that is a ``oneOf``: each variant on its own ``|`` line."""
    out = ""
    for v in variants:
        out += f"\n{indent} | " + _nullable(v, to_typescript(v, indent + "   "))
        comments = _variant_comments(v, False, None, enum_bare=False)
        if comments:
            out += " // " + " ".join(comments)
    return out


def _variant_comments(
    v: Any, skip_description: bool, property_desc: str | None, enum_bare: bool = True
) -> list[str]:
    if not isinstance(v, Mapping):
        return []
    out = []
    desc = v.get("description")
    if not skip_description and isinstance(desc, str) and desc != property_desc:
        out.append(desc)
    if "default" in v:
        out.append("default: " + _default(v, v["default"], enum_bare))
    return out


def _object(schema: Mapping[str, Any], indent: str) -> str:
    out = ""
    desc = schema.get("description")
    if isinstance(desc, str):
        out += f"{indent}// {desc}\n"
    out += "{\n"
    props = schema.get("properties")
    required = schema.get("required")
    needed = {r for r in required if isinstance(r, str)} if isinstance(required, list) else set()
    if isinstance(props, Mapping):
        for key, val in props.items():
            mark = "" if key in needed else "?"
            out += _property_comments(val, indent)
            if isinstance(val, Mapping) and isinstance(val.get("oneOf"), list):
                out += _one_of_property(key, mark, val, indent)
                continue
            out += f"{indent}{key}{mark}: "
            out += _nullable(val, to_typescript(val, indent + "    ")) + ","
            if isinstance(val, Mapping) and "default" in val:
                out += " // default: " + _default(val, val["default"])
            out += "\n"
    return out + f"{indent}}}"


def _property_comments(val: Any, indent: str) -> str:
    """``title``, ``description`` (not for a ``oneOf``: see ``_one_of_property``) and
    ``examples`` of a property, as comment lines above it."""
    if not isinstance(val, Mapping):
        return ""
    out = ""
    title = val.get("title")
    if isinstance(title, str):
        out += f"{indent}// {title}\n{indent}//\n"
    desc = val.get("description")
    if "oneOf" not in val and isinstance(desc, str):
        out += f"{indent}// {desc}\n"
    examples = val.get("examples")
    if isinstance(examples, list) and examples:
        out += f"{indent}// Examples:\n"
        out += "".join(f'{indent}// - "{e}"\n' for e in examples if isinstance(e, str))
    return out


def _one_of_property(key: str, mark: str, val: Mapping[str, Any], indent: str) -> str:
    """A property whose schema is a ``oneOf``: its description (unless the first
    variant repeats it) and default above, then one ``|`` line per variant."""
    variants: list[Any] = val["oneOf"]
    desc = val.get("description")
    prop_desc = desc if isinstance(desc, str) else None
    first = variants[0] if variants else None
    repeated = (
        prop_desc is not None
        and isinstance(first, Mapping)
        and first.get("description") == prop_desc
    )
    out = ""
    above = prop_desc is not None and not repeated
    if above:
        out += f"{indent}// {prop_desc}\n"
    if "default" in val:
        out += f"{indent}// default: " + _default(val, val["default"]) + "\n"
    out += f"{indent}{key}{mark}:\n"
    for i, v in enumerate(variants):
        out += f"{indent} | " + _nullable(v, to_typescript(v, indent + "   "))
        comments = _variant_comments(v, i == 0 and above, prop_desc)
        if comments:
            out += " // " + " ".join(comments)
        out += "\n"
    return out + f"{indent},\n"
