"""rlinfer_core.server_child.command_line: engine arguments spelled as a server's options."""

from __future__ import annotations

import argparse

import pytest

from rlinfer_core.errors import BackendLoadError
from rlinfer_core.server_child import command_line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine serve")
    parser.add_argument("--model")
    parser.add_argument("--port", type=int)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--middleware", action="append")
    parser.add_argument("--stop-ids", nargs="+", type=int)
    parser.add_argument("--override-config")
    return parser


def test_each_kind_of_option() -> None:
    argv = command_line(
        _parser(),
        {
            "model": "/m",
            "port": 8000,
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "middleware": ["a.B", "c.D"],
            "stop_ids": [1, 2],
            "override_config": {"k": 1},
            "unset": None,
        },
        "engine serve",
    )
    assert argv == [
        "--model", "/m", "--port", "8000", "--no-enable-prefix-caching", "--enforce-eager",
        "--middleware", "a.B", "--middleware", "c.D", "--stop-ids", "1", "2", "--override-config", '{"k": 1}',
    ]  # fmt: skip


def test_false_store_true_is_left_out() -> None:
    assert command_line(_parser(), {"enforce_eager": False}, "engine serve") == []


def test_an_argument_without_an_option_is_refused() -> None:
    with pytest.raises(BackendLoadError, match="'colour' has no `engine serve` option"):
        command_line(_parser(), {"colour": "red"}, "engine serve")


def test_options_the_parser_refuses_are_refused() -> None:
    with pytest.raises(BackendLoadError, match="`engine serve` refused the options"):
        command_line(_parser(), {"port": "eighty"}, "engine serve")
