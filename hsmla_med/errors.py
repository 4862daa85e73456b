"""Errors about the user's input: the command line prints their message, without a traceback."""

from __future__ import annotations

__all__ = ["InputError", "ConfigError", "DataError", "find_input_error"]


class InputError(ValueError):
    """Input that cannot be used: a bad file, value or argument. The message names the file."""


class ConfigError(InputError):
    """A configuration file or value that cannot be used."""


class DataError(InputError):
    """A dataset, image or label file that cannot be used."""


def find_input_error(err: BaseException) -> InputError | None:
    """The :class:`InputError` behind ``err``, if any: ``err`` itself or one in its explicit
    cause chain (``raise ... from``).

    MONAI re-raises an exception from a transform as ``RuntimeError(...) from e``; following
    ``__cause__`` finds the original, whose message names the file. ``__context__`` is not
    followed: an exception raised *while handling* an input error (a bug in an ``except``
    block) is not that input error, and must keep its traceback.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, InputError):
            return err
        seen.add(id(err))
        err = err.__cause__
    return None
