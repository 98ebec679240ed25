"""The workdir's layout on a host, named once: the agent joins these names on the host, and the
controller imports this module (stdlib, imports nothing) to name the same files.

    WORKDIR/
      deploy.lock, deploy.holder.json   one actor per host (``lock``)
      notify.json                       the host's webhook, read by supervisors
      agent/<sha16>.py                  the bundle supervisors run from (``start``)
      payloads/<sha16>/<name>           shipped payloads
      envs/<env>/                       built environments' logs and inputs (``build``)
      units/<unit>/                     one folder per unit:
        launch.sh, unit.json            shipped at deploy (0700, 0600)
        secrets.env, secret-args.*      shipped at deploy when the unit has secrets (0600)
        pid, exit, stopped, supervisor.json, progress.json, stop-requested, crashed
                                        written on the host (start, supervisor, stop)
        logs/current.log                -> the unit's current timestamped log
      units/.pruned/<unit>-<stamp>/     folders ``stop --prune`` moved aside
      history/<rev>/revision.json       one per deploy, restart-servers, stop, rollback (``history``)
      history/<rev>/units/<unit>/       that revision's launch.sh and unit.json (the last 10)
      history/rolled.json               units a rollback put on a kept revision

``unit.json`` says what a unit is (name, fingerprint, engine, port, GPUs, stop grace, supervise
policy, the content it runs on); ``UNIT_SCHEMA`` is its format's number, written into it as
``unit_schema``.
"""

from __future__ import annotations

import posixpath

UNITS = "units"
PRUNED = ".pruned"  # under units/
LAUNCH = "launch.sh"
UNIT_RECORD = "unit.json"
UNIT_SCHEMA = 1
PID = "pid"
EXIT = "exit"
STOPPED = "stopped"
SUPERVISOR = "supervisor.json"
PROGRESS = "progress.json"
LOGS = "logs"
CURRENT_LOG = "current.log"
SECRETS_ENV = "secrets.env"
SECRET_ARGS_ENV = "secret-args.env"
SECRET_ARGS_YAML = "secret-args.yaml"  # SGLang and vLLM want a .yaml name
SECRET_FILES = (SECRETS_ENV, SECRET_ARGS_ENV, SECRET_ARGS_YAML)  # the unit's own, 0600
DEPLOY_LOCK = "deploy.lock"
LOCK_HOLDER = "deploy.holder.json"
NOTIFY = "notify.json"
PAYLOADS = "payloads"
ENVS = "envs"
HISTORY = "history"
REVISION = "revision.json"
ROLLED = "rolled.json"  # under history/
KEPT_SCRIPTS = (LAUNCH, UNIT_RECORD)  # what a revision keeps of each unit


def unit_dir(workdir: str, name: str) -> str:
    return posixpath.join(workdir, UNITS, name)


def unit_file(workdir: str, name: str, filename: str) -> str:
    """A unit's file: ``unit_file(workdir, "web", LAUNCH)``."""
    return posixpath.join(workdir, UNITS, name, filename)


def payload(sha256: str, name: str) -> str:
    """Where a payload lands, relative to the workdir."""
    return posixpath.join(PAYLOADS, sha256[:16], name)


def env_dir(workdir: str, env: str) -> str:
    return posixpath.join(workdir, ENVS, env)


def revision_dir(workdir: str, revision: int) -> str:
    return posixpath.join(workdir, HISTORY, str(revision))
