"""One way to read and check every TOML spec and JSON record bimetal takes in: pydantic schemas.

A file's shape is a dataclass (or pydantic model) whose pydantic config forbids unknown keys
(``__pydantic_config__ = SHAPE``). ``check`` validates decoded data against it in pydantic's strict JSON mode
(an integer key refuses ``5.0`` and ``true``, a float key takes ``5``, no string is read as a number) and turns
the first error into one ``UserError`` sentence that names the key and the file. Each kind of file may phrase
that sentence its own way (``explain``), so its messages keep their wording; the default names the source,
the key, and for an unknown key the keys that are known there. ``read_toml`` reads a TOML file with the same
two refusals everywhere (no such file, not TOML).

Field docstrings become the schema's descriptions (``use_attribute_docstrings``), which is where
``bimetal train --help`` takes each config key's doc from.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import tomllib
import types
import typing
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pydantic
from pydantic import ConfigDict, TypeAdapter

from bimetal.errors import UserError

T = TypeVar("T")

SHAPE = ConfigDict(extra="forbid", use_attribute_docstrings=True)
"""The pydantic config of every file shape: unknown keys refused, field docstrings kept as descriptions."""


@dataclass(frozen=True)
class Problem:
    """The first thing wrong with a document, in words a message can use."""

    kind: str
    """``unknown`` (a key the schema does not have), ``missing``, ``type`` (wrong kind of value) or ``value``."""
    key: str
    """Dotted path of the key, list positions as ``[i]``: ``group[0].gpudirect``."""
    value: Any
    """The value found (None for a missing key)."""
    known: tuple[str, ...]
    """The keys the schema allows beside ``key`` (where it has named keys)."""
    detail: str
    """Pydantic's description of what was expected, lower-case (``input should be a valid integer``)."""
    want: str = "value"
    """The kind of value the key takes: ``int``, ``float``, ``str``, ``bool``, ``list``, a table's class name."""


def default_explain(source: str) -> Callable[[Problem], str]:
    """Sentences of the form ``<source>: unknown key 'k'; known keys: ...``."""
    def explain(p: Problem) -> str:
        if p.kind == "unknown":
            known = f"; known keys: {', '.join(p.known)}" if p.known else ""
            return f"{source}: unknown key '{p.key}'{known}."
        if p.kind == "missing":
            return f"{source}: missing key '{p.key}'; add it."
        return f"{source}: key '{p.key}' {p.detail}, got {p.value!r}."
    return explain


@functools.cache
def _adapter(schema: Hashable) -> TypeAdapter[Any]:
    return TypeAdapter(typing.cast(Any, schema))


def _unwrap(tp: Any) -> Any:
    """``X`` of ``Annotated[X, ...]``, ``X | None``, ``list[X]``, ``tuple[X, ...]``."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (list, tuple) or origin is typing.Union or isinstance(tp, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None) and a is not Ellipsis]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _fields_of(tp: Any) -> dict[str, Any]:
    tp = _unwrap(tp)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return typing.get_type_hints(tp)
    if isinstance(tp, type) and issubclass(tp, pydantic.BaseModel):
        return {name: f.annotation for name, f in tp.model_fields.items()}
    return {}


def _type_at(schema: Any, path: tuple[str | int, ...]) -> Any:
    """The type of the value at ``path`` (key names and list positions) of ``schema``; None if it has none."""
    tp: Any = schema
    for step in path:
        tp = _unwrap(tp) if isinstance(step, int) else _fields_of(tp).get(step)
        if tp is None:
            return None
    return tp


def known_keys(schema: Any, path: tuple[str | int, ...] = ()) -> tuple[str, ...]:
    """The keys the table at ``path`` of ``schema`` may hold, in schema order."""
    return tuple(_fields_of(_type_at(schema, path)))


def type_name(schema: Any, path: tuple[str | int, ...]) -> str:
    """``int``, ``float``, ``str``, ``bool``, ``list``, ... : the kind of value ``path`` of ``schema`` takes."""
    tp = _type_at(schema, path)
    if tp is None:
        return "value"
    origin = typing.get_origin(_unwrap_optional(tp))
    tp = origin or _unwrap_optional(tp)
    return getattr(tp, "__name__", str(tp))


def _unwrap_optional(tp: Any) -> Any:
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin is typing.Union or isinstance(tp, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _dotted(loc: tuple[str | int, ...]) -> str:
    out = ""
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out


_UNKNOWN = ("extra_forbidden", "unexpected_keyword_argument")


def problem_of(schema: Any, error: pydantic.ValidationError) -> Problem:
    """The first error of a validation, as a ``Problem``; an unknown key goes first (a misspelt key is the
    likelier cause of a missing one)."""
    errors = error.errors(include_url=False)
    e = next((x for x in errors if x["type"] in _UNKNOWN), errors[0])
    loc = tuple(e["loc"])
    kind = "unknown" if e["type"] in _UNKNOWN else "missing" if e["type"] in ("missing", "missing_argument") else None
    if kind is None:
        kind = "type" if e["type"].endswith("_type") or e["type"].endswith("_parsing") else "value"
    detail = e["msg"][:1].lower() + e["msg"][1:]
    value = None if kind == "missing" else e.get("input")
    return Problem(kind, _dotted(loc), value, known_keys(schema, loc[:-1]), detail, type_name(schema, loc))


def check(schema: type[T], data: Any, source: str, explain: Callable[[Problem], str] | None = None) -> T:
    """``data`` (decoded TOML or JSON) as an instance of ``schema``; raises one ``UserError`` naming key and file.

    ``source`` names the file (or record) in the default sentence; ``explain`` phrases the sentence instead.
    """
    try:
        text = json.dumps(data, default=str, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{source} holds a value that is not plain data ({exc}).") from None
    try:
        return typing.cast(T, _adapter(typing.cast(Hashable, schema)).validate_json(text, strict=True))
    except pydantic.ValidationError as exc:
        raise UserError((explain or default_explain(source))(problem_of(schema, exc))) from None


def not_a_file(path: str | Path) -> str | None:
    """Why a file the user named cannot be read as one ("does not exist", "is a folder", ...), or None: the
    one wording of every input-file check, so a folder is never reported missing."""
    p = Path(path)
    if p.is_file():
        return None
    if p.is_dir():
        return "is a folder, not a file"
    if p.exists():
        return "is not a regular file"
    return "does not exist"


def read_toml(path: str | Path, missing: str, invalid: str) -> dict[str, Any]:
    """The decoded TOML file at ``path``. ``missing`` is the sentence for no such file; ``invalid`` is a format
    string with ``{error}`` for a file that is not TOML."""
    p = Path(path)
    why = not_a_file(p)
    if why == "does not exist":
        raise UserError(missing)
    if why:
        raise UserError(f"{p} {why}; give the path of a TOML file.")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UserError(invalid.format(error=exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(invalid.format(error=exc)) from None


def descriptions(schema: Any) -> dict[str, str]:
    """Field name -> its docstring (on one line) of a schema dataclass or model, from its JSON schema."""
    props = _adapter(_unwrap(schema)).json_schema().get("properties", {})
    return {name: " ".join(str(p.get("description", "")).split()) for name, p in props.items()}
