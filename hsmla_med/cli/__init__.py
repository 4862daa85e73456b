"""The ``hsmla-med`` command line: one module per command, each with its parser (``add_parser``)
and its run (``run``); :mod:`~hsmla_med.cli.options` holds the options several commands share and
the options tasks declare on their cards, :mod:`~hsmla_med.cli.invocation` what one run of a
command keeps (its command line, the folders it created), :mod:`~hsmla_med.cli.main` the parser
and the error handling.

Configuration flows one way: the task's packaged YAML (``configs/<task>.yaml``), then a user YAML
(``--config``, merged over it; unknown keys are refused), then the command-line options. Errors
about the user's input print one line naming the file and the problem (``--debug`` shows the
traceback); anything else is a bug and keeps its traceback.
"""

from hsmla_med.cli.main import build_parser, main

__all__ = ["main", "build_parser"]
