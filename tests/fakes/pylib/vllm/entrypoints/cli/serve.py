"""Fake ``vllm.entrypoints.cli.serve.ServeSubcommand``: the ``serve`` parser (a positional
model and the flags of dflashops/data/vllm-flags.txt, see pylib/_fakeparser.py) and its
``validate`` (vLLM's native multi-node rules, as the fake server applies them)."""

from __future__ import annotations

import argparse

from _fakeparser import add_flags


class ServeSubcommand:
    name = "serve"

    def subparser_init(self, subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(self.name, usage="vllm serve [model_tag] [options]")
        parser.add_argument("model_tag", nargs="?")
        add_flags(parser, "vllm")
        return parser

    def validate(self, args: argparse.Namespace) -> None:
        if args.headless and not args.node_rank:
            raise ValueError("--headless is for the nodes of rank 1 and up, not rank 0")
