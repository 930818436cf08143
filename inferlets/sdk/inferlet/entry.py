"""The entry point: `@inferlet.main` turns a function into the component's `run` export.

componentize-py looks for a class named `WitWorld` in the app module; the decorator defines it
there. `run` calls the function with the instance's arguments and turns what happens into the
WIT result: a returned str (or None -> "", other values -> JSON) is ok; an exception is err with
its message, MemoryError named as such (the guest would otherwise abort with a bare trap).
"""
from __future__ import annotations

import argparse
import difflib  # noqa: F401  - argparse imports these lazily; a guest can only use what
import json
import locale  # noqa: F401  - was imported while the app loaded (see _warm_up_argparse)
import shutil  # noqa: F401
import sys
import textwrap  # noqa: F401
import traceback

from inferlet._wit import Err
from inferlet.errors import InferletError
from inferlet.fast_args import parse_simple
from inferlet.model import arguments

__all__ = ["main", "ArgumentParser", "HelpFormatter"]


class _HelpRequested(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


HELP_WIDTH = 78   # what argparse picks without a terminal (80 columns less 2)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter at HELP_WIDTH columns unless given a width: an inferlet has no
    terminal, and asking for its size is a dozen environment lookups a formatter (argparse
    builds one per add_argument)."""

    def __init__(self, prog: str, *args, width: int | None = None, **kwargs) -> None:
        super().__init__(prog, *args, width=HELP_WIDTH if width is None else width, **kwargs)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for inferlets: `--help` becomes the result, a bad argument an InferletError.

    Defaults differ from argparse's where an inferlet has no terminal: `formatter_class` is
    HelpFormatter (fixed width) and, on Python 3.14+, `color` is False: the help text is a
    result for a client, and argparse otherwise checks for a colour terminal at every
    formatter it builds. Measured in the guest: parsing text_completion's ten options took
    4-6 ms of a 9 ms launch-to-first-forward, most of it in those checks."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        if sys.version_info >= (3, 14):
            kwargs.setdefault("color", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """argparse's parse, by `parse_simple` for a plain command line (a tenth of the cost)."""
        if args is not None and namespace is None:
            parsed = parse_simple(self, list(args))
            if parsed is not None:
                return parsed
        return super().parse_args(args, namespace)

    def print_help(self, file=None) -> None:
        raise _HelpRequested(self.format_help())

    def error(self, message: str):
        raise InferletError(f"{self.format_usage().strip()}\n{self.prog}: error: {message}")


def _warm_up_argparse() -> None:
    """Run argparse's parse, help and error paths once at load time, so every module they
    import lazily is bundled into the component (a run-time import would fail)."""
    parser = ArgumentParser(prog="warm-up", description="warm up")
    parser.add_argument("--count", type=int, default=0, help="a number")
    parser.add_argument("--flag", action="store_true")
    parser.add_argument("--many", action="append")
    parser.add_argument("--choice", choices=["a", "b"])
    parser.add_argument("name", nargs="?")
    parser.parse_args(["--count", "1", "--flag", "--many", "x", "--choice", "a", "n"])
    parser.format_help()
    for bad in (["--count", "x"], ["--nope"], ["--choice", "c"]):
        try:
            parser.parse_args(bad)
        except InferletError:
            pass


_warm_up_argparse()


def _to_result(value) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, MemoryError):
        return "MemoryError: the inferlet ran out of memory (its memory limit)"
    if isinstance(exc, InferletError):
        return str(exc)
    if isinstance(exc, Err):
        return f"host error: {exc.value}"
    lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return "".join(lines).strip()


def run_entry(func) -> str:
    """Call `func` the way `run` does; raise Err for an error result."""
    try:
        args = arguments()
        result = func(args) if func.__code__.co_argcount else func()
        return _to_result(result)
    except _HelpRequested as help_request:
        return help_request.text
    except SystemExit as exit_request:
        if exit_request.code in (None, 0):
            return ""
        raise Err(f"the inferlet exited with status {exit_request.code}") from None
    except BaseException as exc:   # noqa: BLE001 - every failure becomes the error result
        raise Err(_describe(exc)) from None


def main(func):
    """Make `func(args: list[str]) -> str | None` (or `func()`) the inferlet's entry point."""
    module = sys.modules[func.__module__]

    class WitWorld:
        """The component's exports (componentize-py finds this class in the app module)."""

        def run(self) -> str:
            return run_entry(func)

    module.WitWorld = WitWorld
    return func
