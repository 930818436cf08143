"""A short path for `ArgumentParser.parse_args` over the common command line.

argparse's parse is general (abbreviations, `--opt=value`, negative numbers, positionals,
mutually exclusive groups, ...) and costs ~25 us natively, ~240 us in the guest: a tenth of an
instance's start. Most inferlet command lines are plain: every option spelled out, each value
the next argument. `parse_simple` parses exactly those, as argparse would, and declines
everything else (argparse then parses, and reports any error with its own message).

It reads argparse's own tables (`_option_string_actions`, `_actions`, `_defaults`,
`_registry_get`), unchanged since Python 3.2.
"""
from __future__ import annotations

import argparse

__all__ = ["parse_simple"]

_STORE_ACTIONS = (argparse._StoreAction, argparse._StoreConstAction, argparse._StoreTrueAction,
                  argparse._StoreFalseAction)         # exactly these types: no custom __call__
_DECLINED = object()                                  # _convert's failure (None is a value)


def parse_simple(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace | None:
    """`parser.parse_args(args)` when every argument is an option string of a store or
    store-const action (store_true, store_false) given exactly, each store's value the next
    argument and not starting with a prefix character, and the parser has no positionals, no
    required options, no mutually exclusive groups and no fromfile prefix. None otherwise, or
    when a value does not convert or is not among its choices (argparse reports it)."""
    if (parser.fromfile_prefix_chars or parser._mutually_exclusive_groups
            or any(not a.option_strings or a.required for a in parser._actions)):
        return None
    values = _read_values(parser, args)
    if values is None:
        return None
    namespace = argparse.Namespace()
    for action in parser._actions:                   # argparse's order: action defaults ...
        if action.dest is not argparse.SUPPRESS and action.default is not argparse.SUPPRESS:
            setattr(namespace, action.dest, action.default)
    for dest, default in parser._defaults.items():   # ... then the parser's own
        if not hasattr(namespace, dest):
            setattr(namespace, dest, default)
    for action, value in values.items():
        setattr(namespace, action.dest, value)
    for action in parser._actions:                   # a str default not given: converted
        default = action.default
        if (action not in values and isinstance(default, str)
                and getattr(namespace, action.dest, None) is default):
            converted = _convert(parser, action, default)
            if converted is _DECLINED:
                return None
            setattr(namespace, action.dest, converted)
    return namespace


def _read_values(parser: argparse.ArgumentParser, args: list[str]) -> dict | None:
    """{action: its value (the last given)} for a plain command line; None otherwise."""
    values: dict = {}
    index = 0
    while index < len(args):
        action = parser._option_string_actions.get(args[index])
        if type(action) not in _STORE_ACTIONS or getattr(action, "deprecated", False):
            return None           # unknown, abbreviated, --help, append...; deprecated: a warning
        if action.nargs == 0:
            values[action] = action.const
            index += 1
            continue
        if action.nargs is not None or index + 1 >= len(args):
            return None
        text = args[index + 1]
        if text[:1] and text[:1] in parser.prefix_chars:
            return None                               # argparse decides: a negative number?
        value = _convert(parser, action, text)
        choices = action.choices
        if value is _DECLINED or (choices is not None
                                  and (isinstance(choices, str) or value not in choices)):
            return None                               # str choices: argparse's rule changed
        values[action] = value
        index += 2
    return values


def _convert(parser: argparse.ArgumentParser, action: argparse.Action, text: str):
    """`text` through the action's type, as argparse converts it; _DECLINED on any failure."""
    convert = parser._registry_get("type", action.type, action.type)
    if not callable(convert):
        return _DECLINED
    try:
        return convert(text)
    except Exception:                                 # noqa: BLE001 -- argparse reports it
        return _DECLINED
