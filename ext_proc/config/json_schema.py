"""A JSON Schema (draft 2020-12) of the YAML config, generated from the very dataclasses the
loader decodes (`ext_proc/config/load.py` `decode`), for editors (`gorgo config-schema`).

Each section is a `$defs` entry named after its class: its fields as properties (the
loader's types: integer, number, string, boolean, a list, an enum's values, a nested
section), each field's range (`bounded(...)`) as minimum / exclusiveMinimum / maximum, its
default, the keys without a default as `required`, and `additionalProperties: false`, as
the loader refuses unknown keys. `policies.<name>` takes each registered policy's own
parameter class; `policy` the registered names. A section renamed (`bus`, once `fleet`)
takes its old name too, marked `deprecated`, never both. Descriptions are the code's own: a
section's docstring, and the comment lines right above a field (an enum's members'
comments are appended to the field's). The checks across fields (`load._validate`: host:port
forms, backend ids, files that must exist, ...) are the loader's alone: the schema holds the
shape, `gorgo check` the rest.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import textwrap
from functools import cache
from typing import Any, get_args, get_origin, get_type_hints

from ext_proc.config.dump import plain_value
from ext_proc.config.schema import Config
from ext_proc.policy.catalog import POLICIES
from ext_proc.vocab.params import Range

DIALECT = "https://json-schema.org/draft/2020-12/schema"
TITLE = "GORGO router config (gorgo serve --config)"


@cache
def _comments_in(cls: type) -> dict[str, str]:
    """The comment lines right above each annotated name in a class's own body (a field
    or an enum member), joined into one line; {} when its source is not at hand."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return {}
    tree = ast.parse(textwrap.dedent("".join(lines)))
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            name = node.target.id
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            name = node.targets[0].id
        else:
            continue
        said: list[str] = []
        i = node.lineno - 2  # the line above, 0-based
        while i >= 0 and lines[i].strip().startswith("#"):
            said.insert(0, lines[i].strip().lstrip("#").strip())
            i -= 1
        if said:
            out[name] = " ".join(said)
    return out


def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment, from the class that declares it (a subclass's wins)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        out.update(_comments_in(klass))
    return out


def _doc(obj: type) -> str:
    text = inspect.getdoc(obj) or ""
    return " ".join(text.split())


class SchemaBuilder:
    """Builds the schema; `defs` collects each section class's schema once, by name."""

    def __init__(self) -> None:
        self.defs: dict[str, dict[str, Any]] = {}

    def section(self, cls: type) -> dict[str, Any]:
        """A `$ref` to the section's definition (made on first use)."""
        name = cls.__name__
        if name not in self.defs:
            self.defs[name] = {}  # reserved first: a section may nest itself
            self.defs[name] = self.object_of(cls)
        return {"$ref": f"#/$defs/{name}"}

    def object_of(self, cls: type) -> dict[str, Any]:
        hints = get_type_hints(cls)
        comments = field_comments(cls)
        properties: dict[str, Any] = {}
        required: list[str] = []
        renamed: list[tuple[str, str]] = []
        for f in dataclasses.fields(cls):
            if f.metadata.get("decode") == "policies":
                prop = self.policies()
            else:
                prop = self.value(hints[f.name])
            limits = f.metadata.get("range")
            if isinstance(limits, Range):
                prop.update(_range(limits))
            default = _default(f)
            if default is not dataclasses.MISSING:
                prop["default"] = default
            elif f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            described = " ".join(
                s for s in (comments.get(f.name, ""), prop.pop("description", "")) if s
            )
            if described:
                prop["description"] = described
            properties[f.name] = prop
            if old := f.metadata.get("renamed_from"):  # the loader still takes the old name
                renamed.append((f.name, old))
                said = f"Renamed `{f.name}`: write `{f.name}:` instead (this name still loads)."
                properties[old] = {**prop, "description": said, "deprecated": True}
        out: dict[str, Any] = {"type": "object"}
        if doc := _doc(cls):
            out["description"] = doc
        out["properties"] = properties
        if required:
            out["required"] = required
        if renamed:  # a section under both its names is refused
            out["not"] = {"anyOf": [{"required": [new, old]} for new, old in renamed]}
        out["additionalProperties"] = False
        return out

    def value(self, typ: Any) -> dict[str, Any]:
        """The schema of one value of a field's type, as `load._convert` accepts it."""
        if dataclasses.is_dataclass(typ) and isinstance(typ, type):
            return self.section(typ)
        if isinstance(typ, type) and issubclass(typ, enum.StrEnum):
            return _enum(typ)
        if get_origin(typ) is tuple:
            (item, _ellipsis) = get_args(typ)
            return {"type": "array", "items": self.value(item)}
        simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
        if typ in simple:
            return {"type": simple[typ]}
        raise TypeError(f"no JSON Schema for the config type {typ!r}")

    def policies(self) -> dict[str, Any]:
        """`policies:`: each registered policy's parameters (a policy given no value, as
        `gorgo:` alone, takes its defaults); no other name."""
        props: dict[str, Any] = {}
        for name in sorted(POLICIES):
            ref = self.section(POLICIES[name].params)
            props[name] = {"anyOf": [ref, {"type": "null"}]}
        return {"type": "object", "properties": props, "additionalProperties": False}


def _number(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


def _range(r: Range) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    if r.gt is not None:
        out["exclusiveMinimum"] = _number(r.gt)
    if r.ge is not None:
        out["minimum"] = _number(r.ge)
    if r.le is not None:
        out["maximum"] = _number(r.le)
    return out


def _enum(typ: type[enum.StrEnum]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "string", "enum": [m.value for m in typ]}
    comments = _comments_in(typ)
    if any(m.name in comments for m in typ):  # what each value means, where the code says
        said = (f"{m.value}: {comments.get(m.name, '').rstrip('.')}" for m in typ)
        out["description"] = "Values: " + "; ".join(said) + "."
    return out


def _default(f: dataclasses.Field[Any]) -> Any:
    """The field's default as JSON (a section's default is its fields' own: none here)."""
    if f.default is not dataclasses.MISSING:
        return plain_value(f.default)
    if f.default_factory is not dataclasses.MISSING:
        made = f.default_factory()
        if not dataclasses.is_dataclass(made):
            return plain_value(made)
    return dataclasses.MISSING


def config_schema() -> dict[str, Any]:
    """The whole config's JSON Schema."""
    builder = SchemaBuilder()
    root = builder.object_of(Config)
    # `policy` is a string the loader checks against the registry.
    root["properties"]["policy"]["enum"] = sorted(POLICIES)
    # Backends listed, or found by discovery (the loader's rule across the two keys).
    root["anyOf"] = [
        {"required": ["backends"], "properties": {"backends": {"minItems": 1}}},
        {"required": ["discovery"]},
    ]
    return {"$schema": DIALECT, "title": TITLE, **root, "$defs": builder.defs}
