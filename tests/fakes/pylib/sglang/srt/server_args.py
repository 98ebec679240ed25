"""Fake ``sglang.srt.server_args``: ``ServerArgs.add_cli_args`` and ``prepare_server_args``, as
dflashops' parse check calls them (see pylib/_fakeparser.py). ``--model-path`` is required, as
in SGLang."""

from __future__ import annotations

import argparse
from typing import Any

from _fakeparser import add_flags


class ServerArgs:
    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        add_flags(parser, "sglang")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        return cls(**vars(args))


def prepare_server_args(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    raw = parser.parse_args(argv)
    if raw.model_path is None:
        parser.error("the following arguments are required: --model-path")
    return ServerArgs.from_cli_args(raw)
