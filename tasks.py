"""This repo is an ops repo too: `invoke preflight`, `invoke render --host local`, ..."""

from dflashops.tasks import namespace

__all__ = ["namespace"]
