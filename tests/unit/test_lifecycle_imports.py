"""The lifecycle package's shape (issue 20; STYLE.md "Standing limits"): the read-only commands
load a host session, never the deploy executor. (No import cycle anywhere in the package:
test_standing_limits.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXECUTOR = ("dflashops.lifecycle.deploy", "dflashops.lifecycle.stage", "dflashops.agent.transfer")


def test_read_only_commands_never_load_the_deploy_executor() -> None:
    # A fresh interpreter: this test run's own imports must not hide what the commands load.
    code = (
        "import json, sys\n"
        "import dflashops.commands.status, dflashops.commands.top, dflashops.commands.logs\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('dflashops'))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    )
    loaded = set(json.loads(proc.stdout))
    assert "dflashops.stage" not in loaded
    assert not loaded & set(EXECUTOR), sorted(loaded & set(EXECUTOR))
    assert "dflashops.lifecycle.session" in loaded  # what they use instead
