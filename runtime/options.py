"""Range checks of command-line numbers, shared by the CLIs: refused at parse time, before any work starts."""

from __future__ import annotations

import argparse


def require_at_least(parser: argparse.ArgumentParser, limits: dict[str, tuple[float, float]]) -> None:
    """limits: option -> (value given, least allowed); the first value below its least is a usage error (exit 2)."""
    for option, (value, least) in limits.items():
        if value < least:
            parser.error(f"{option} {value}: give at least {least}")


def port_number(text: str) -> int:
    """argparse `type` of a TCP port to listen on: 1 .. 65535."""
    value = int(text) if text.lstrip("-").isdigit() else -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port: give a number from 1 to 65535")
    return value
