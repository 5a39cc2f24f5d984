"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""


class MoebenchError(Exception):
    """Base class for user-facing errors."""


class ConfigError(MoebenchError, ValueError):
    """A bad preset, override, suite entry or parallel layout."""
