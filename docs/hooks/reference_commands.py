"""reference/commands.md: every `geserve` command and flag, with its default and help, from the argparse parsers.

Defaults. `serve` and `ray-serve` set every default of the server's flags to argparse.SUPPRESS, so that a flag not
given leaves a GESERVE_<SETTING> variable in force; what applies then is ServerSettings' default, shown here for each
flag that sets a setting (with the variable's name). A server flag that sets no setting shows the default of a parser
built the same way before that step (`_add_serve_arguments`); every other flag shows its parser's own default. A flag
without help text is described by its setting's docstring in geserve/settings.py.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from reference_markdown import GENERATED_NOTE, anchor, code, table, text

from geserve import settings as settings_module
from geserve.cli import _add_serve_arguments, _bool, build_parser
from geserve.settings import NOT_FROM_ENVIRONMENT, ServerSettings

_ENV_PREFIX = "GESERVE_"
_INTRO = """\
# Commands

{note}

Every `geserve` command and flag, generated from the command line's parsers when this site is built.

**Defaults.** For `geserve serve` and `geserve ray-serve`, a server flag that is not given leaves its
`GESERVE_<SETTING>` environment variable (column *environment*) in force, and without one the setting's default
applies: that default is what the *default* column shows. The command line overrides the environment, which overrides
the defaults. `—` means none (an empty list, an empty string, or not set).
"""


@dataclass(frozen=True)
class _Settings:
    """What the server flags' rows need from geserve.settings and from a parser built before SUPPRESS."""

    defaults: dict[str, Any]
    docs: dict[str, str]
    unsuppressed: dict[str, Any]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """The parser's subcommands by name, in the order they were added, each with its one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return {name: (subparser, helps.get(name, "")) for name, subparser in action.choices.items()}
    return {}


def documented_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's arguments, help and subcommand actions left out."""
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def row_id(command: str, action: argparse.Action) -> str:
    """`serve-http-port`: the command, then the argument's first long option (or its name), without dashes."""
    longs = [o for o in action.option_strings if o.startswith("--")] or action.option_strings
    name = longs[0].lstrip("-") if longs else action.dest
    return f"{command}-{name}".replace("_", "-")


def page() -> str:
    parser = build_parser()
    known = _Settings(_settings_defaults(), _settings_docs(), _unsuppressed_defaults())
    lines = [_INTRO.format(note=GENERATED_NOTE.format(source=Path(__file__).name))]
    lines += _section("geserve", parser, parser.description or "", known)
    for name, (subparser, summary) in subcommands(parser).items():
        lines += _section(name, subparser, summary, known)
    return "\n".join(lines) + "\n"


def _settings_defaults() -> dict[str, Any]:
    defaults = ServerSettings()
    return {item.name: getattr(defaults, item.name) for item in fields(ServerSettings)}


def _settings_docs() -> dict[str, str]:
    """The docstring under each ServerSettings field, by field name."""
    source = ast.parse(inspect.getsource(settings_module))
    body = next(n.body for n in source.body if isinstance(n, ast.ClassDef) and n.name == ServerSettings.__name__)
    docs = {}
    for field, after in itertools.pairwise(body):
        if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and _is_docstring(after):
            docs[field.target.id] = inspect.cleandoc(after.value.value)  # type: ignore[attr-defined]
    return docs


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _unsuppressed_defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    _add_serve_arguments(parser)
    return {action.dest: action.default for action in parser._actions}


def _section(command: str, parser: argparse.ArgumentParser, summary: str, known: _Settings) -> list[str]:
    title = "geserve" if command == "geserve" else f"geserve {command}"
    actions = documented_actions(parser)
    environment = any(_is_setting(a, known) for a in actions)
    header = ["argument", "value", "default", *(["environment"] if environment else []), "description"]
    rows = [_row(command, action, known, environment) for action in actions]
    return ["", f"## `{title}`", "", text(summary), "", *table(header, rows)]


def _is_setting(action: argparse.Action, known: _Settings) -> bool:
    """A server flag left to its setting: its default suppressed, its destination a ServerSettings field."""
    return action.default is argparse.SUPPRESS and action.dest in known.defaults


def _row(command: str, action: argparse.Action, known: _Settings, environment: bool) -> list[str]:
    names = " ".join(code(o) for o in action.option_strings) or code(str(action.metavar or action.dest))
    setting = _is_setting(action, known)
    cells = [f"{anchor(row_id(command, action))}{names}", _value(action), _default(action, known)]
    if environment:
        readable = setting and action.dest not in NOT_FROM_ENVIRONMENT
        cells.append(code(_ENV_PREFIX + action.dest.upper()) if readable else "")
    described = action.help or (known.docs.get(action.dest, "") if setting else "")
    return [*cells, text(described)]


def _default(action: argparse.Action, known: _Settings) -> str:
    if action.required:
        return "required"
    if action.default is not argparse.SUPPRESS:
        return _shown(action.default)
    if action.dest in known.defaults:
        return _shown(known.defaults[action.dest])
    return _shown(known.unsuppressed.get(action.dest))  # None for --version, whose default is SUPPRESS too


def _shown(value: Any) -> str:
    if value is None or value == "" or (isinstance(value, list | dict | tuple) and not value):
        return "—"
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, float):
        return code(str(int(value)) if value.is_integer() else repr(value))
    if isinstance(value, list | tuple):
        return code(",".join(str(item) for item in value))
    return code(str(value))


def _value(action: argparse.Action) -> str:
    """What the argument takes: nothing (a switch), its choices, or a placeholder; [...] when it may be left out."""
    if action.nargs == 0:
        return ""
    if action.choices:
        shown = "{" + ",".join(str(c) for c in action.choices) + "}"
    elif isinstance(action.metavar, str):
        shown = action.metavar
    else:
        shown = _placeholder(action)
    if action.nargs == "?":
        shown = f"[{shown}]"
    if action.nargs in ("*", "+"):
        shown = f"{shown} ..."
    return code(shown)


def _placeholder(action: argparse.Action) -> str:
    if action.type is _bool:
        return "true|false"
    names: dict[Any, str] = {int: "INT", float: "NUMBER", Path: "PATH"}
    return names.get(action.type, action.dest.upper())
