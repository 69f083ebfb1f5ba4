"""The serve job's clients (`push`, `stage`, `rollback`, `status`, `stop`) without Typer's parsing.

They are run once per checkpoint from training scripts, where start-up is part of every push:
Typer builds a pydantic validator for each option it parses, and the whole command tree with
Rich help before that, which together cost more than a push's own round trip. Here a plain
command line is read against the same declarations (each command's `Annotated[...,
typer.Option(...)]` parameters), so a flag is defined once. Anything else - help, an unknown,
repeated-short or malformed flag, a value out of range, a missing required flag, an option
read from a list-valued environment variable - returns None, and Typer takes the command line
and answers as it always does.
"""

from __future__ import annotations

import enum
import inspect
import math
import os
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

COMMANDS = {
    "push": "push_command",
    "stage": "stage_command",
    "rollback": "rollback_command",
    "status": "status_command",
    "stop": "stop_command",
}

_NOT_MINE = object()  # a command line for Typer


def run(args: Sequence[str]) -> int | None:
    """Run `args` when it is a plain command line of a client command: its exit code; None
    when Typer should take it."""
    if not args or args[0] not in COMMANDS:
        return None
    import typer

    from ckptctl.cli import serve
    from ckptctl.cli._errors import handle_errors

    command = getattr(serve, COMMANDS[args[0]])
    kwargs = parse(command, list(args[1:]))
    if kwargs is None:
        return None
    try:
        handle_errors(command)(**kwargs)
    except typer.Exit as exc:
        return int(exc.exit_code)
    return 0


def parse(command: Callable[..., Any], argv: list[str]) -> dict[str, Any] | None:
    """The keyword arguments `argv` gives `command`, or None where Typer should decide."""
    specs = _specs(command)
    if specs is None:
        return None
    by_flag = {flag: spec for spec in specs.values() for flag in spec.flags}
    given: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=") if argv[i].startswith("--") else (argv[i], "", "")
        spec = by_flag.get(flag)
        if spec is None:
            return None
        if spec.kind is bool:
            if eq:
                return None
            given[spec.name] = True
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                return None
            value = argv[i + 1]
        i += 1 if eq else 2
        if not value or value.startswith("-") and not _is_number(value):
            return None  # (`--timeout --json`: Typer says what that means)
        converted = _convert(spec.kind, value)
        if converted is _NOT_MINE:
            return None
        if spec.many:
            given.setdefault(spec.name, []).append(converted)
        else:
            given[spec.name] = converted
    kwargs: dict[str, Any] = {}
    for spec in specs.values():
        if spec.name in given:
            value = given[spec.name]
        else:
            value = _from_env(spec)
            if value is _NOT_MINE:
                return None
        if value is inspect.Parameter.empty:
            return None  # a required flag is missing
        if spec.callback is not None:
            try:
                value = spec.callback(value)
            except Exception:  # noqa: BLE001 - Typer reports it, with its usage line
                return None
        kwargs[spec.name] = value
    return kwargs


class _Spec(typing.NamedTuple):
    name: str
    flags: tuple[str, ...]
    kind: type
    many: bool
    default: Any
    envvar: str | None
    callback: Callable[[Any], Any] | None


def _specs(command: Callable[..., Any]) -> dict[str, _Spec] | None:
    """The command's options, where each is one this module reads as Typer would."""
    from typer.models import OptionInfo

    hints = typing.get_type_hints(command, include_extras=True)
    specs = {}
    for name, param in inspect.signature(command).parameters.items():
        hint = hints[name]
        info = next(
            (m for m in getattr(hint, "__metadata__", ()) if isinstance(m, OptionInfo)), None
        )
        if info is None:
            return None
        if not info.expose_value:
            continue  # --help: never on a line taken here (not among the flags)
        kind, many = _kind(hint.__origin__)
        unusual = (
            info.parser, info.min, info.max, info.count, info.prompt, info.exists,
            info.resolve_path, info.default_factory, info.is_eager,
        )  # fmt: skip
        # Annotated[..., typer.Option("--name", ...)]: the first name sits in `default`.
        first = [info.default] if isinstance(info.default, str) else []
        flags = tuple(first + list(info.param_decls or ()))
        if kind is None or any(unusual) or any("/" in f for f in flags):
            return None
        if not flags or not all(f.startswith("-") for f in flags):
            return None
        callback = info.callback
        if callback is not None and len(inspect.signature(callback).parameters) != 1:
            return None
        envvar = info.envvar
        if isinstance(envvar, list):
            return None
        specs[name] = _Spec(name, flags, kind, many, param.default, envvar, callback)
    return specs


def _kind(annotation: Any) -> tuple[Any, bool]:
    """(the value's type, whether the flag may repeat) for the types these commands use;
    (None, False) for any other."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            return None, False
        annotation = rest[0]
        args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and args == (str,):
        return str, True
    if annotation in (bool, str, float, int, Path):
        return annotation, False
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation, False  # (a choice: its value, as Typer takes it)
    return None, False


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _convert(kind: type, text: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        return _NOT_MINE
    if isinstance(value, float) and not math.isfinite(value):
        return _NOT_MINE
    return value


def _from_env(spec: _Spec) -> Any:
    """A flag not on the command line: its environment variable, else its default."""
    text = os.environ.get(spec.envvar) if spec.envvar else None
    if not text:
        return spec.default
    if spec.many or spec.kind is bool:
        return _NOT_MINE  # (how Typer splits or reads those: its business)
    return _convert(spec.kind, text)
