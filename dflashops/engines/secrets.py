"""Secret engine flags (``secret_args``) delivered without argv (DESIGN.md "Trust boundary" 4).

Each flag goes the engine's own way, chosen here, and its value reaches the host only inside a
0600 file in the unit's folder, written at deploy time beside secrets.env:

- vLLM's ``api-key``: ``VLLM_API_KEY`` in secrets.env. vLLM reads that variable; an
  ``--api-key`` on the command line would win over it, so it is never passed as well.
- SGLang (and the stub, which speaks its flags), and vLLM's other secret flags: the engine's
  own ``--config FILE``, a YAML file holding only the secret flags (written in JSON form, which
  YAML reads; keys are flag names with dashes). Both engines put the file's flags before the
  command line's.
- A ``command`` service or a job (any program; no engine to ask): secret-args.env, read by the
  launch script into shell variables (not exported) that become the flags' values at exec time.
  Only there does the value end up in the process's argv, as a program that takes it only as a
  flag requires; it is never in the script, the banner, unit.json or any output.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dflashops.agent.remote import layout
from dflashops.engines.base import SecretArgs, ShellVar, Token, UnitFile
from dflashops.engines.protocol import protocol

if TYPE_CHECKING:
    from dflashops.plan import Unit

SECRETS_ENV = layout.SECRETS_ENV
CONFIG_FILE = layout.SECRET_ARGS_YAML
ARGS_FILE = layout.SECRET_ARGS_ENV
VLLM_KEY_VAR = "VLLM_API_KEY"


def split(unit: Unit) -> SecretArgs:
    """Which way each of the unit's secret_args goes. A Ray node runs `ray start`, not the
    engine: its API server unit carries the flags."""
    wanted = dict(unit.spec.secret_args)
    if not wanted or unit.engine == "ray":
        return SecretArgs()
    if unit.engine == "vllm":
        key = wanted.pop("api-key", None)
        return SecretArgs(env={VLLM_KEY_VAR: key} if key else {}, config=wanted)
    if protocol(unit.engine) is not None:  # SGLang and vLLM read their own --config FILE
        return SecretArgs(config=wanted)
    return SecretArgs(argv={_var(i): src for i, src in enumerate(wanted.values())})


def _var(i: int) -> str:
    return f"DFLASHOPS_SECRET_ARG_{i}"


def flags(unit: Unit, secrets: SecretArgs) -> list[Token]:
    """What the engine's command line gets instead of the values."""
    if secrets.config:
        return ["--config", UnitFile(CONFIG_FILE)]
    names = list(unit.spec.secret_args)
    return [t for i in range(len(secrets.argv)) for t in (f"--{names[i]}", ShellVar(_var(i)))]


def checked_flags(unit: Unit, secrets: SecretArgs) -> list[str]:
    """The flags as the engine will parse them, for pre-flight's flag-list check."""
    inside = [f"--{flag}" for flag in secrets.config]
    if secrets.env:
        inside.append("--api-key")
    return [*(["--config"] if secrets.config else []), *inside]


def files(
    secrets: SecretArgs, secret_env: Mapping[str, str], environ: Mapping[str, str]
) -> dict[str, bytes]:
    """The unit's secret files by name (each 0600 on the host), from ``environ``'s values;
    a missing variable is left out (the caller refuses to start the unit without it)."""
    out: dict[str, bytes] = {}
    env = {**secret_env, **secrets.env}
    if env:
        out[SECRETS_ENV] = _assignments(env, environ)
    if secrets.config:
        values = {flag: environ[src] for flag, src in secrets.config.items() if src in environ}
        out[CONFIG_FILE] = (json.dumps(values, indent=1, ensure_ascii=False) + "\n").encode()
    if secrets.argv:
        out[ARGS_FILE] = _assignments(secrets.argv, environ)
    return out


def _assignments(names: Mapping[str, str], environ: Mapping[str, str]) -> bytes:
    return "".join(
        f"{k}={shlex.quote(environ[v])}\n" for k, v in sorted(names.items()) if v in environ
    ).encode()


def bearer(unit: Unit, secrets: SecretArgs) -> dict[str, str] | None:
    """Where the unit's supervisor finds the API key its liveness probe sends (a 0600 file of
    the unit's own): ``{file, name}``, or None without a secret api-key."""
    if VLLM_KEY_VAR in secrets.env:
        return {"file": SECRETS_ENV, "name": VLLM_KEY_VAR}
    if "api-key" in secrets.config:
        return {"file": CONFIG_FILE, "name": "api-key"}
    if "api-key" in unit.spec.secret_args and secrets.argv:
        i = list(unit.spec.secret_args).index("api-key")
        return {"file": ARGS_FILE, "name": _var(i)}
    return None


def auth_headers(unit: Unit, environ: Mapping[str, str]) -> dict[str, str]:
    """The Bearer header the controller's probes send: the key from the controller's
    environment (as deployed), never from the playbook's text."""
    source = unit.spec.secret_args.get("api-key")
    key = environ.get(source) if source else None
    return {"Authorization": f"Bearer {key}"} if key else {}


SECRET_WORDS = ("token", "secret", "password")


def looks_secret(flag: str) -> bool:
    """A flag whose value is a credential: api-key, admin-api-key, hf-token, *-token,
    *-secret, *-password (underscores count as dashes)."""
    name = flag.lower().replace("_", "-")
    last = name.rsplit("-", 1)[-1]
    return name.endswith("api-key") or last in SECRET_WORDS
