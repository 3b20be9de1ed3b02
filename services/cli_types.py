"""The value types of the command line's options: each parses one option's text or says precisely why not."""

from __future__ import annotations

import argparse
import re

UNITS = {
    "": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text, re.ASCII)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def block_size(text: str) -> int:
    value = int(text)
    if value <= 0 or value % 16:
        raise argparse.ArgumentTypeError(f"must be a positive multiple of 16, got {value}")
    return value
