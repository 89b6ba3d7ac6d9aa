"""The manual stays true to the code: README.md and docs/*.md, checked with no rank started.

* every internal link resolves: the file, and a ``#anchor`` against the target's headings (GitHub's slugs);
  every page under docs/ can be reached from README.md;
* every ``bimetal ...`` command shown (fenced blocks, inline code) names a command and sub-command the CLI has,
  and only options that command's ``--help`` lists (its parser, run in this process) or config keys
  (``--section.key``) of ``bimetal.config``; every ``python -m bimetal...`` module exists, every ``make`` target
  exists, every repository path shown exists; every config key named in prose (``parallel.tp``) exists;
* docs/environment.md is what ``bimetal.env.reference_page`` renders from the variable table;
* docs/architecture.md's layer table is pyproject's import-linter layers, and its code map names every
  top-level module and every package of bimetal/;
* README.md stays a front door: at most 12 KiB.

Fenced blocks tagged ``toml``, ``json`` or ``python`` hold no commands; in a block tagged ``text`` (output) or
with ``$ `` prompts, only the prompted lines are commands. ``bimetal <word>: ...`` is a message bimetal prints, not a
command. Options of ``bimetal titan`` that its own parser lacks are torchtitan's and are not checked here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import re
import shlex
import tomllib
import typing
from functools import cache
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 12 * 1024
NO_COMMANDS = {"text", "toml", "json", "python", "diff"}
PATH_RE = re.compile(r"^(?:bimetal|tests|configs|scripts|docs|\.ci)/[\w./*-]*$")
FENCE_RE = re.compile(r"^\s*(```+|~~~+)\s*([\w-]*)")
SPAN_RE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


@dataclasses.dataclass
class Page:
    path: Path
    prose: str
    """The text outside fenced blocks."""
    blocks: list[tuple[str, list[str]]]
    """Fenced blocks: (info string, lines)."""

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


@cache
def page(path: Path) -> Page:
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    fence: str | None = None
    for line in path.read_text().splitlines():
        m = FENCE_RE.match(line)
        if fence is None and m:
            fence = m.group(1)
            blocks.append((m.group(2).lower(), []))
        elif fence is not None and line.strip().startswith(fence) and not line.strip()[len(fence):].strip():
            fence = None
        elif fence is not None:
            blocks[-1][1].append(line)
        else:
            prose.append(line)
    return Page(path, "\n".join(prose), blocks)


def spans(p: Page) -> list[str]:
    """Inline code spans, whitespace folded (a span may run over a line break)."""
    return [" ".join(m.group(2).split()) for m in SPAN_RE.finditer(p.prose)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in page(path).prose.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(p: Page) -> list[str]:
    return LINK_RE.findall(SPAN_RE.sub("", p.prose))


# -- links --------------------------------------------------------------------------------------------------------

def link_problems(path: Path) -> list[str]:
    bad = []
    for target in links(page(path)):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto:
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            bad.append(f"{path.name}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{path.name}: {target}: no heading with that anchor in {dest.name}")
    return bad


def test_every_internal_link_resolves() -> None:
    bad = [problem for path in PAGES for problem in link_problems(path)]
    assert not bad, "\n".join(bad)


def test_the_link_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A page\n\n## Its part\n\n[ok](#its-part) [ok](b.md#b) [code `x`](b.md)\n"
                                   "[gone](c.md) [no anchor](b.md#nope) `[in code](c.md)`\n\n"
                                   "```\n[in a block](c.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n")
    assert link_problems(tmp_path / "a.md") == ["a.md: c.md: no such file",
                                                "a.md: b.md#nope: no heading with that anchor in b.md"]


def test_every_page_under_docs_is_reached_from_the_readme() -> None:
    reached, todo = set(), [ROOT / "README.md"]
    while todo:
        path = todo.pop()
        if path in reached:
            continue
        reached.add(path)
        for target in links(page(path)):
            file = target.partition("#")[0]
            dest = (path.parent / file).resolve()
            if file.endswith(".md") and not re.match(r"^[a-z]+:", target) and dest.exists():
                todo.append(dest)
    missing = [str(p.relative_to(ROOT)) for p in PAGES if p not in reached]
    assert not missing, f"no link from README.md leads to {missing}; link each from README.md or a page it links"


# -- commands -----------------------------------------------------------------------------------------------------

def shown_commands(p: Page) -> list[str]:
    """Command lines shown on a page: fenced shell lines (continuations joined) and inline spans."""
    lines: list[str] = []
    for info, body in p.blocks:
        if info in NO_COMMANDS and info != "text":
            continue
        joined: list[str] = []
        for line in body:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1] + " " + line.strip()
            else:
                joined.append(line.strip())
        prompted = info == "text" or any(line.startswith("$ ") for line in joined)
        for line in joined:
            if prompted and not line.startswith("$ "):
                continue
            lines.append(line.removeprefix("$ "))
    return lines + spans(p)


def words(line: str) -> list[str]:
    try:
        out = shlex.split(line, comments=True)
    except ValueError:
        out = line.split()
    cut = next((i for i, w in enumerate(out) if w in ("|", "&&", ";", "||")), len(out))
    return [w.strip("[]") for w in out[:cut] if w.strip("[]") and w != "..."]


@cache
def cli_help(argv: tuple[str, ...]) -> tuple[int, str]:
    """``bimetal ARGV --help`` in this process: (exit status, what it printed)."""
    from bimetal.cli import main

    out = io.StringIO()
    # the command's exit runs gc.collect() (0.4 s a call with torch loaded); --help holds no process group to free
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), mock.patch("gc.collect"):
        try:
            rc = main([*argv, "--help"])
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, out.getvalue()


@cache
def config_keys() -> set[str]:
    from bimetal.config import TrainConfig

    return {f"{name}.{key.name}" for name, section in typing.get_type_hints(TrainConfig).items()
            if dataclasses.is_dataclass(section) for key in dataclasses.fields(section)}


def check_bimetal(argv: list[str]) -> list[str]:
    """Problems of one ``bimetal ...`` command line (argv without ``bimetal``)."""
    from bimetal.cli import COMMANDS

    if not argv:
        return []
    command, rest = argv[0], argv[1:]
    if command.startswith("<"):
        return []  # a placeholder: bimetal <command>
    if command not in COMMANDS:
        return [f"no command {command!r} (the commands are {', '.join(COMMANDS)})"]
    if "--" in rest:
        rest = rest[:rest.index("--")]  # what follows is the program's, or torchtitan's
    parser: tuple[str, ...] = (command,)
    positional = next((w for w in rest if not w.startswith("-")), None)
    if positional is not None and rest.index(positional) == 0:
        rc, text = cli_help((command, positional))
        if rc != 0:
            return [f"bimetal {command} {positional}: not a sub-command, and bimetal {command} takes no such "
                    f"argument: {text.strip()}"]
        if re.search(rf"usage: bimetal {re.escape(command)} {re.escape(positional)}\b", text) or \
                cli_help((command,))[0] != 0:  # named in its usage, or the command needs a sub-command
            parser = (command, positional)
            rest = rest[1:]
    rc, text = cli_help(parser)
    if rc != 0:
        return [f"bimetal {' '.join(parser)} --help failed: {text.strip()}"]
    known = set(re.findall(r"(?<![\w-])--[\w][\w.-]*", text))
    problems = []
    for word in rest:
        if not word.startswith("--") or word == "--" or command == "titan":
            continue  # titan: what its own parser lacks is torchtitan's
        option = word.split("=", 1)[0]
        if option != option.lower():
            continue  # a placeholder: --SECTION.KEY
        if "." in option:
            if option[2:] not in config_keys():
                problems.append(f"{option}: no such config key in bimetal.config")
        elif option not in known:
            problems.append(f"bimetal {' '.join(parser)} has no option {option}")
    return problems


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def check_line(line: str) -> list[str]:
    w = words(line)
    while w and (re.match(r"^[A-Z_]+=", w[0]) or w[0] in ("sudo", "timeout") or w[0].isdigit()):
        w = w[1:]  # VAR=value, sudo, timeout N
    problems: list[str] = []
    for i, word in enumerate(w):
        module = w[i + 1] if word == "-m" and i + 1 < len(w) else ""
        if module.startswith("bimetal") and importlib.util.find_spec(module) is None:
            problems.append(f"no module {module}")
        path = word.split("::")[0].rstrip(":,.")
        if PATH_RE.match(path) and not (ROOT / path).exists() and not list(ROOT.glob(path)):
            problems.append(f"no file {path}")
    if not w:
        return problems
    if w[0] in ("bimetal", ".venv/bin/bimetal"):
        if len(w) > 1 and w[1].endswith(":"):
            return problems  # a message bimetal prints, quoted
        problems += check_bimetal(w[1:])
    elif w[0] == "make" and len(w) > 1 and not w[1].startswith("-"):
        problems += [f"no make target {t}" for t in w[1:] if "=" not in t and t not in make_targets()]
    return problems


def test_every_command_shown_exists() -> None:
    bad = []
    for path in PAGES:
        p = page(path)
        for line in shown_commands(p):
            bad += [f"{p.name}: `{line}`: {problem}" for problem in check_line(line)]
    assert not bad, "\n".join(bad)


FILE_SUFFIXES = {"py", "json", "jsonl", "toml", "md", "txt", "safetensors"}


def key_problem(span: str) -> str | None:
    """A config key named in prose (`parallel.tp`, `--checkpoint.every=5`) that bimetal.config lacks."""
    sections = {key.split(".")[0] for key in config_keys()}
    m = re.match(r"^(?:--)?([a-z_]+)\.([a-z_0-9]+)(?:$|[=\s])", span)
    if m and m.group(1) in sections and m.group(2) not in FILE_SUFFIXES and \
            f"{m.group(1)}.{m.group(2)}" not in config_keys():
        return f"no config key {m.group(1)}.{m.group(2)} in bimetal.config"
    return None


def test_every_config_key_named_exists() -> None:
    bad = [f"{page(path).name}: `{span}`: {problem}" for path in PAGES for span in spans(page(path))
           if (problem := key_problem(span))]
    assert not bad, "\n".join(bad)
    assert key_problem("parallel.no_such_key") and key_problem("--training.stepz=3")
    assert not key_problem("parallel.tp") and not key_problem("metrics.jsonl")


def test_the_command_check_can_fail() -> None:
    """The checks above, on lines that are wrong."""
    assert check_line("bimetal trian --config configs/demo.toml")
    assert check_line("bimetal bench nope")
    assert check_line("bimetal train --config configs/demo.toml --no-such-option")
    assert check_line("bimetal train --parallel.no_such_key=2")
    assert check_line("bimetal lab run --spec configs/lab/missing.toml -- -m bimetal.train")
    assert check_line("python -m bimetal.no_such_module")
    assert check_line("make no-such-target")
    assert not check_line("bimetal plan configs/clusters/h200_mi325x.toml --ladder")
    assert not check_line("bimetal plan fit configs/clusters/h200_mi325x.toml --bench-comm x.json --out y.toml")
    assert not check_line("BIMETAL_CF_STRIPES=2 bimetal bench comm --sizes 4K --transports gloo,cpu-forward")
    assert not check_line("bimetal train: run.toml: data.batch_size=7 must be a multiple")


# -- generated and mirrored tables --------------------------------------------------------------------------------

def test_the_variable_page_is_generated_from_env_py() -> None:
    from bimetal.env import VARIABLES, reference_page

    committed = (ROOT / "docs" / "environment.md").read_text()
    assert committed == reference_page(), "docs/environment.md is stale: run `python scripts/env_page.py`"
    for name in VARIABLES:
        assert f"| `{name}` |" in committed


def test_the_architecture_page_matches_the_import_contracts_and_the_tree() -> None:
    text = page(ROOT / "docs" / "architecture.md").prose
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    want = [sorted(m.strip() for m in re.split(r"[|:]", row)) for row in layers]
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|") and "`bimetal" in line]
    got = [sorted(re.findall(r"`(bimetal[\w.]*)`", row.split("|")[2])) for row in rows]
    assert got == want, "docs/architecture.md's layer table differs from pyproject.toml [tool.importlinter]"
    named = set(spans(page(ROOT / "docs" / "architecture.md")))
    tree = [p for p in sorted((ROOT / "bimetal").iterdir()) if p.name != "__init__.py" and (
        p.suffix == ".py" or (p / "__init__.py").exists())]
    tree += [p for p in sorted((ROOT / "bimetal").glob("*/*/__init__.py"))]
    want_names = {str(p.parent.relative_to(ROOT)) + "/" if p.name == "__init__.py" else
                  str(p.relative_to(ROOT)) + ("/" if p.is_dir() else "") for p in tree}
    missing = sorted(want_names - named)
    assert not missing, f"docs/architecture.md's code map does not name {missing}"


def test_the_readme_is_a_front_door() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes; keep it under {README_LIMIT}: move detail to docs/"


@pytest.mark.parametrize("text, want", [
    ("2. Network interfaces: named, or chosen", "2-network-interfaces-named-or-chosen"),
    ("Know before you launch: `--dry-run`", "know-before-you-launch---dry-run"),
])
def test_slug(text: str, want: str) -> None:
    assert slug(text) == want
