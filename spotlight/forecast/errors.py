"""The forecast's one error type (a leaf: every forecast module raises it)."""

from __future__ import annotations

from spotlight.config import ConfigError


class ForecastError(ConfigError):
    """Bad forecast input (a trace, a price, a curve, a parameter); the message names it. A ConfigError,
    so the CLI prints it as one line and exits 2."""
