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
    """The :class:`InputError` behind ``err``, if any.

    MONAI and the DataLoader re-raise exceptions from transforms wrapped in ``RuntimeError``;
    walking ``__cause__``/``__context__`` finds the original, whose message names the file.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, InputError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None
