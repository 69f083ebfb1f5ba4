"""Flag errors found while Typer parses the command line, said in one line.

Typer reports them in a five-line box, in the words of the validation library underneath
("Input should be a valid integer, unable to parse string as an integer"), and suggests any
flag that shares a few letters (`--bogus`: "Possible options: --uds, --verbose"). A script
reading stderr wants one line that names the flag, the value and what it takes. Only Typer's
public exception (`typer.TyperException`: its `format_message()`) is read; the wording below
is matched loosely, and anything not recognised is passed on as Typer said it.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence

# (pattern on Typer's message, our wording); {flag} and {value} are filled in from argv.
_VALUE_PROBLEMS: tuple[tuple[str, str], ...] = (
    (r"valid integer", "{flag} takes a whole number, not {value}"),
    (r"valid number", "{flag} takes a number, not {value}"),
    (r"valid boolean", "{flag} takes true or false, not {value}"),
    (r"greater than or equal to (\S+)", "{flag} must be at least {0}, not {value}"),
    (r"greater than (\S+)", "{flag} must be more than {0}, not {value}"),
    (r"less than or equal to (\S+)", "{flag} must be at most {0}, not {value}"),
    (r"less than (\S+)", "{flag} must be less than {0}, not {value}"),
    (r"is not one of (.*?)\.?$", "{flag} takes one of {choices}, not {value}"),
    (r"does not exist", "{flag}: {value} does not exist"),
)


def describe(message: str, args: Sequence[str]) -> str:
    """One line for Typer's `message` about the command line `args`."""
    message = message.strip()
    # (A flag read from the environment too is named with its variable: "'--engine' (env var:
    # 'CKPTCTL_ENGINE')".)
    bad_value = re.match(
        r"Invalid value for '?([^':]+)'?(?: \(env var: '([^']*)'\))?: (.*)", message, re.S
    )
    if bad_value:
        flag, envvar, problem = bad_value.group(1), bad_value.group(2), bad_value.group(3)
        problem = " ".join(problem.split())
        value = value_of(flag, args)
        shown = repr(value) if value is not None else "that"
        if value is None and envvar and envvar in os.environ:
            shown = f"{os.environ[envvar]!r} (from {envvar})"
        for pattern, wording in _VALUE_PROBLEMS:
            m = re.search(pattern, problem)
            if m:
                choices = ", ".join(re.findall(r"'([^']*)'", m.group(1))) if m.groups() else ""
                return wording.format(*m.groups(), flag=flag, value=shown, choices=choices)
        problem = problem.removeprefix("Value error, ").rstrip(".")
        # Our own callbacks (_options.at_least) say "must be ...", to follow the flag's name.
        return f"{flag} {problem}" if problem.startswith("must ") else f"{flag}: {problem}"
    unknown = re.match(r"No such option: (\S+)(?: \(Possible options: (.*)\))?", message)
    if unknown:
        flag = unknown.group(1)
        # Typer lists any flag sharing a few letters; keep only a close misspelling.
        near = suggest(flag, (unknown.group(2) or "").split(", "))
        return f"no such option {flag}" + (f"; did you mean {near}?" if near else "")
    missing = re.match(r"Missing (option|argument) (.*?)\.?$", message)
    if missing:
        names = re.findall(r"'([^']*)'", missing.group(2)) or [missing.group(2)]
        name = names[0] if missing.group(1) == "option" else names[0].upper()
        return f"{name} is required"
    needs = re.match(r"Option '([^']+)' requires an argument", message)
    if needs:
        return f"{needs.group(1)} needs a value"
    command = re.match(r"No such command '([^']*)'\.(?: Did you mean '([^']*)'\?)?", message)
    if command:
        near = f"; did you mean {command.group(2)}?" if command.group(2) else ""
        return f"no such command {command.group(1)!r}{near}"
    extra = re.match(r"Got unexpected extra argument(?:s|\(s\))? \((.*)\)", message)
    if extra:
        return f"unexpected argument(s): {extra.group(1)}"
    return " ".join(message.split()).rstrip(".")


def value_of(flag: str, args: Sequence[str]) -> str | None:
    """The value given to `flag` in `args` (`--flag V` or `--flag=V`), the last one if repeated."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def suggest(flag: str, options: Sequence[str]) -> str | None:
    """The option `flag` was probably meant to be, only when it is a close misspelling
    (`--endpont` → `--endpoint`; `--bogus` → nothing)."""
    bare = flag.lstrip("-")
    best, score = None, 0.0
    for option in options:
        if not option.startswith("--"):
            continue
        ratio = difflib.SequenceMatcher(None, bare, option.lstrip("-")).ratio()
        if ratio > score:
            best, score = option, ratio
    return best if score >= 0.8 else None
