"""User-facing errors.

Every failure a user can cause or fix is raised as one of these, with a message that fits on one
line and says what to do. The CLI prints the message and exits with ``exit_code``; library users
catch :class:`IceCacheError`.
"""

from __future__ import annotations


class IceCacheError(Exception):
    """Base class. ``exit_code`` 1: a runtime failure (environment, model, resources)."""

    exit_code = 1


class UsageError(IceCacheError):
    """Bad input from the user: arguments, files, profiles. Exit code 2."""

    exit_code = 2


class InputError(UsageError):
    """A document that cannot be read or used (missing, binary, empty, too long)."""


class ProfileError(UsageError):
    """A hardware profile or setting that does not validate."""


class ModelError(IceCacheError):
    """A model that cannot be found or loaded."""


class MethodUnavailable(UsageError):
    """A ``--method`` that is known but not implemented yet, or unknown."""
