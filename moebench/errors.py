"""Errors that reach the user as one clear line (the CLI prints them without a traceback)."""


class MoebenchError(Exception):
    """Base class for user-facing errors."""


class ConfigError(MoebenchError, ValueError):
    """A bad preset, override, suite entry, option value or parallel layout."""


class StoreError(MoebenchError):
    """A results store that cannot be read or written (corrupt line, locked, missing)."""


class LaunchError(MoebenchError):
    """A run that could not be started or whose ranks failed."""
