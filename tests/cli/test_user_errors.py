"""`cli/user_errors.py`: the package's own refusal of its input ends a command with one `error: ...` line and status
2, as jsonargparse's refusals do; the same exception types raised outside the package (a bug, or a library's
check), or with `JSONARGPARSE_DEBUG=true`, keep their traceback."""

from __future__ import annotations

import pytest

from lightning_megatron.cli.user_errors import EXIT_STATUS, input_errors_reported, is_input_error
from lightning_megatron.families import family


def test_the_packages_own_refusal_prints_one_error_line_and_exits_2(capsys, monkeypatch) -> None:
    monkeypatch.delenv("JSONARGPARSE_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exited, input_errors_reported():
        family("no_such_family")
    assert exited.value.code == EXIT_STATUS == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("error: model_type: 'no_such_family' is not a family this package knows")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_the_same_types_raised_elsewhere_keep_their_traceback(monkeypatch) -> None:
    monkeypatch.delenv("JSONARGPARSE_DEBUG", raising=False)
    with pytest.raises(ValueError, match="invalid literal"), input_errors_reported():
        int("twelve")  # raised by Python, not by a `raise` of the package: a bug to report with its traceback
    with pytest.raises(KeyError), input_errors_reported():  # not an input-error type at all
        {}["missing"]


def test_jsonargparse_debug_shows_the_traceback_of_a_refusal(monkeypatch) -> None:
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(ValueError, match="is not a family") as raised, input_errors_reported():
        family("no_such_family")
    assert is_input_error(raised.value)


def test_a_command_called_from_python_with_its_arguments_raises_the_mistake(monkeypatch) -> None:
    """`main([...])` from a notebook or a test gets the exception to catch, not an exit."""
    monkeypatch.delenv("JSONARGPARSE_DEBUG", raising=False)
    with pytest.raises(ValueError, match="is not a family"), input_errors_reported(on_the_command_line=False):
        family("no_such_family")
