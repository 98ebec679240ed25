"""Fake ``vllm.utils.argparse_utils.FlexibleArgumentParser`` (plain argparse here)."""

from __future__ import annotations

import argparse


class FlexibleArgumentParser(argparse.ArgumentParser):
    pass
