"""Every `laminar-node` help text renders: the top level and each command's (a bare `%` in a
help string makes argparse raise instead of printing the help)."""
from __future__ import annotations

import argparse

from laminar.cli import build_parser


def test_every_help_text_renders():
    parser = build_parser()
    assert "eval" in parser.format_help()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert subs, "laminar-node has no commands"
    for name, sub in subs[0].choices.items():
        assert sub.format_help().startswith("usage:"), name
