"""Errors phrased for users, on the ground floor so every package can raise them."""

from __future__ import annotations

import argparse
import functools
import os
import reprlib


class ConfigError(ValueError):
    """A configuration mistake, phrased for the user: the key, the value, and what to do."""


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 2, 80, 80, 40
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxset = _SHOWN.maxfrozenset = _SHOWN.maxdict = 6
SHOWN_MAX = 160


def shown(value) -> str:
    """repr(value) for an error line, cut to a line's worth (`[1, 2, ...]`, at most SHOWN_MAX characters): a value in
    a config can be anything YAML builds, and a 327-byte file of nested aliases is a list whose repr is 58 MB."""
    text = _SHOWN.repr(value)
    return text if len(text) <= SHOWN_MAX else text[: SHOWN_MAX - 3] + "..."


def yaml_shown(value) -> str:
    """A config value as its YAML is written (false, true, null), else `shown`: the key=value a message asks for."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return shown(value)


_GIVEN = "_tpframe_options_given"  # {action: how it was given}, on the namespace while one parse runs
_REPEATABLE = (
    argparse._AppendAction,
    argparse._AppendConstAction,
    argparse._CountAction,
    argparse._HelpAction,
    argparse._VersionAction,
)


@functools.cache
def _once(cls: type) -> type:
    """`cls` (an argparse action) refusing a second use in one parse: argparse would keep the last silently."""

    class Once(cls):
        def __call__(self, parser, namespace, values, option_string=None):
            given = getattr(namespace, _GIVEN, None)
            text = (
                option_string
                if self.nargs == 0
                else " ".join([option_string, *(map(str, values) if isinstance(values, list) else [str(values)])])
            )
            if given is not None and self in given:
                raise argparse.ArgumentError(self, f"given twice ({given[self]} and {text}); give it once")
            if given is not None:
                given[self] = text
            super().__call__(parser, namespace, values, option_string)

    Once.__name__ = Once.__qualname__ = cls.__name__
    return Once


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage mistakes raise one ConfigError line pointing at --help (argparse prints usage + error),
    and which refuses an option given twice (`--temperature 0.5 --temperature 0.8`; argparse keeps the last one
    silently); options meant to repeat say so with action="append"."""

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        if action.option_strings and not isinstance(action, _REPEATABLE):
            action.__class__ = _once(type(action))
        return action

    def parse_known_args(self, args=None, namespace=None):
        namespace = argparse.Namespace() if namespace is None else namespace
        setattr(namespace, _GIVEN, {})
        try:
            return super().parse_known_args(args, namespace)
        finally:
            if hasattr(namespace, _GIVEN):
                delattr(namespace, _GIVEN)

    def error(self, message: str):
        raise ConfigError(f"{message} (see {self.prog} --help)")


def env_int(name: str, default: int | None, low: int, *, hint: str = "") -> int | None:
    """Environment variable `name` as an integer >= `low` (`default` when unset); a ConfigError naming it
    (+ `hint`) otherwise."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"env var {name}={raw!r} must be an integer{hint}") from None
    if value < low:
        raise ConfigError(f"env var {name}={raw!r} must be at least {low}{hint}")
    return value
