"""Errors phrased for users, on the ground floor so every package can raise them."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration mistake, phrased for the user: the key, the value, and what to do."""
