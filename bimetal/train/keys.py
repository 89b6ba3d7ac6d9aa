"""Every config key with its default and meaning, from the config schema (``bimetal/config.py``).

``bimetal train --help`` prints this list, so it cannot drift from the dataclasses: the schema keeps the
string literal written under each field as its description (``bimetal.schema``), a section's being the one
under its field of ``TrainConfig``.
"""

from __future__ import annotations

import dataclasses
import textwrap
import typing
from dataclasses import dataclass

from bimetal import config
from bimetal.schema import descriptions


@dataclass(frozen=True)
class KeyDoc:
    """One config key: ``section.key``, its default as TOML-ish text and its docstring."""

    section: str
    key: str
    default: str
    doc: str


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def config_keys() -> tuple[dict[str, str], list[KeyDoc]]:
    """(section -> section doc, every key in file order) of ``TrainConfig``."""
    sections = descriptions(config.TrainConfig)
    keys: list[KeyDoc] = []
    hints = typing.get_type_hints(config.TrainConfig)
    for sec in dataclasses.fields(config.TrainConfig):
        cls = hints[sec.name]
        docs, defaults = descriptions(cls), cls()
        keys += [KeyDoc(sec.name, f.name, _text(getattr(defaults, f.name)), docs.get(f.name, ""))
                 for f in dataclasses.fields(cls)]
    return sections, keys


def format_keys(width: int = 100) -> str:
    """The key list as help text: ``[section]`` headers, then ``key = default`` and the wrapped doc."""
    sections, keys = config_keys()
    lines = ["config keys (TOML [section] key = value, or --section.key=value; CLI > file > defaults):"]
    current = ""
    for k in keys:
        if k.section != current:
            current = k.section
            lines += ["", f"[{k.section}]  {sections.get(k.section, '')}"]
        lines.append(f"  {k.key} = {k.default}")
        lines += textwrap.wrap(k.doc.replace("``", "`"), width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)
