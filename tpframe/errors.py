"""Errors phrased for users, on the ground floor so every package can raise them."""

from __future__ import annotations

import argparse


class ConfigError(ValueError):
    """A configuration mistake, phrased for the user: the key, the value, and what to do."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage mistakes raise one ConfigError line pointing at --help (argparse prints usage + error)."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see {self.prog} --help)")
