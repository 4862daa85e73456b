"""Which failures the command line reports as one-line input errors: an InputError itself or
the explicit cause of a wrapper; never a bug raised while an input error was being handled."""

from __future__ import annotations

import pytest

from hsmla_med.errors import DataError, find_input_error


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - the test inspects whatever was raised
        return err
    raise AssertionError("nothing raised")


def _bad_file():
    raise DataError("scan.nii.gz: cannot read as NIfTI")


def _wrapped():  # as MONAI's apply_transform re-raises a transform's error
    try:
        _bad_file()
    except Exception as err:
        raise RuntimeError("applying transform LoadImaged") from err


def _bug_while_handling():
    try:
        _bad_file()
    except DataError as err:
        return err.missing_attribute  # AttributeError, with the DataError as its __context__


def test_the_error_itself_and_its_explicit_cause_are_input_errors():
    assert str(find_input_error(_raised(_bad_file))) == "scan.nii.gz: cannot read as NIfTI"
    assert str(find_input_error(_raised(_wrapped))) == "scan.nii.gz: cannot read as NIfTI"


def test_a_bug_raised_while_handling_an_input_error_is_not_one():
    err = _raised(_bug_while_handling)
    assert isinstance(err, AttributeError) and isinstance(err.__context__, DataError)
    assert find_input_error(err) is None


def test_the_cli_gives_such_a_bug_its_traceback(monkeypatch, capsys):
    import hsmla_med.cli as cli
    from hsmla_med.cli import export

    monkeypatch.setattr(export, "run", lambda args, invocation: _bug_while_handling())
    with pytest.raises(AttributeError):
        cli.main(["export", "--checkpoint", "x.ckpt", "--format", "onnx", "--output", "out"])
