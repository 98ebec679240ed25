"""Run on this machine: the embedded default host (`connection: local`), no SSH involved."""

from __future__ import annotations

import subprocess

from dflashops.hosts.base import BaseConnection
from dflashops.hosts.connection import Command, CommandError, CommandTimeout, Result, as_shell


class LocalConnection(BaseConnection):
    def __init__(self, host: str) -> None:
        self.host = host

    def run(
        self,
        command: Command,
        *,
        input: bytes | None = None,
        timeout: float | None = 60.0,
        check: bool = True,
    ) -> Result:
        shell = as_shell(command)
        self.commands += 1
        try:
            # bash -c like sshd's session shell would; start_new_session keeps our terminal's
            # Ctrl-C from reaching what the command starts.
            proc = subprocess.run(
                ["bash", "-c", shell],
                input=input if input is not None else b"",
                capture_output=True,
                timeout=timeout,
                check=False,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired:
            raise CommandTimeout(
                self.host, f"command timed out after {timeout:.0f}s: {shell[:200]}"
            ) from None
        result = Result(shell, proc.returncode, proc.stdout, proc.stderr)
        if check and result.exit_code != 0:
            raise CommandError(self.host, result)
        return result

    def close(self) -> None:
        return None
