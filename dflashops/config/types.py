"""Constrained value types shared by the inventory and playbook models.

Values end up in shell scripts and on SSH command lines, so anything that could be read as shell
or as an option is refused here, at the edge, with a message that says what is allowed.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FLAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
ADDRESS_RE = re.compile(r"^[A-Za-z0-9_.:%\[\]][A-Za-z0-9_.:%\[\]-]*$")
USER_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*\$?$")
KEY_TYPES = {
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
}
# Linux interface names: at most 15 bytes, no '/' or whitespace (IFNAMSIZ).
NET_IF_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@-]{0,14}$")
_DURATION_RE = re.compile(
    r"^\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s)?\s*$"
)


def _matching(pattern: re.Pattern[str], refusal: str) -> Callable[[str], str]:
    """A validator that keeps a value ``pattern`` matches whole and refuses any other with
    ``refusal`` after the value itself (which says what is allowed)."""

    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            raise ValueError(f"{value!r} {refusal}")
        return value

    return check


_name = _matching(
    NAME_RE,
    "is not a valid name: use lowercase letters, digits and '-', "
    "starting with a letter or digit, at most 63 characters",
)
_env_name = _matching(
    ENV_NAME_RE, "is not a valid environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
)
_address = _matching(
    ADDRESS_RE,
    "is not a host name, IP address or ~/.ssh/config alias "
    "(letters, digits, '.', '-', ':'; not starting with '-')",
)
_user = _matching(USER_RE, "is not a valid login name")
_net_if = _matching(
    NET_IF_RE,
    "is not a network interface name (like 'ens1', 'eth0', 'ib0': letters, "
    "digits, '_', '.', ':', '@', '-', at most 15 characters)",
)


def _path(value: str) -> str:
    if not value:
        raise ValueError("path is empty")
    if "\n" in value or "\r" in value or "\x00" in value:
        raise ValueError("paths may not contain newlines or NUL characters")
    return _text(value)


def _text(value: str) -> str:
    if "\x00" in value:
        raise ValueError("values may not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("values must be valid Unicode text (found a lone surrogate)") from None
    return value


RESERVED_ENV = ("CUDA_VISIBLE_DEVICES",)


def _env_keys(env: dict[str, object]) -> dict[str, object]:
    for key in env:
        if key in RESERVED_ENV or (
            key.startswith("DFLASHOPS_") and not key.startswith("DFLASHOPS_STUB_")
        ):
            raise ValueError(
                f"{key} is set by dflashops itself (GPUs come from `gpus:`, DFLASHOPS_* describe the unit); remove it"
            )
    return env


def _host_key(value: str) -> str:
    parts = value.split()
    if len(parts) < 2 or parts[0] not in KEY_TYPES:
        raise ValueError(
            "expected an OpenSSH public key line like 'ssh-ed25519 AAAAC3Nz...'; "
            "`dflashops trust --host NAME` fetches and pins it for you"
        )
    try:
        base64.b64decode(parts[1], validate=True)
    except ValueError:
        raise ValueError("the key's second field is not valid base64") from None
    return f"{parts[0]} {parts[1]}"


def parse_duration(value: Any) -> float:
    """'20m', '5s', '1h30m', '90' or a number -> seconds."""
    if isinstance(value, bool):
        raise ValueError("expected a duration like '30s', '20m' or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            match = _DURATION_RE.fullmatch(text)
            if not text or not match or not any(match.groups()):
                raise ValueError(
                    f"{value!r} is not a duration: use forms like '30s', '20m', '1h30m'"
                ) from None
            h, m, s = (float(g) if g else 0.0 for g in match.groups())
            seconds = h * 3600 + m * 60 + s
    else:
        raise ValueError("expected a duration like '30s', '20m' or a number of seconds")
    if seconds <= 0 or seconds != seconds or seconds > 7 * 24 * 3600:
        raise ValueError("a duration must be positive and at most a week")
    return seconds


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(?:i?B)?|B)?\s*", re.IGNORECASE)
_SIZE_UNITS = {None: 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
SIZE_MIN, SIZE_MAX = 64 << 10, 1 << 40


def parse_size(value: Any) -> int:
    """'1GiB', '256M', '64KiB', '1048576' or a number -> bytes (K, M, G, T are powers of 1024)."""
    if isinstance(value, bool):
        raise ValueError("expected a size like '1GiB', '256MiB' or a number of bytes")
    if isinstance(value, (int, float)):
        size = float(value)
    elif isinstance(value, str) and (match := _SIZE_RE.fullmatch(value)):
        unit = match.group(2).upper() if match.group(2) else None
        size = float(match.group(1)) * _SIZE_UNITS[unit]
    else:
        raise ValueError(f"{value!r} is not a size: use forms like '1GiB', '256MiB', '64KiB'")
    if not SIZE_MIN <= size <= SIZE_MAX:
        raise ValueError("a size must be between 64KiB and 1TiB")
    return int(size)


def _scalar_to_str(value: Any) -> Any:
    # YAML reads `SGLANG_FLAG: 1` as an int; environment values are strings, so accept numbers.
    # Booleans are refused: `yes` would silently become "True".
    if isinstance(value, bool):
        raise ValueError('write booleans as quoted strings ("1", "true") so the value is exact')
    if isinstance(value, (int, float)):
        return str(value)
    return value


Name = Annotated[str, AfterValidator(_name)]
NetIf = Annotated[str, AfterValidator(_net_if)]
EnvName = Annotated[str, AfterValidator(_env_name)]
EnvValue = Annotated[str, BeforeValidator(_scalar_to_str), AfterValidator(_text)]
PathStr = Annotated[str, AfterValidator(_path)]
Text = Annotated[str, AfterValidator(_text)]
Address = Annotated[str, AfterValidator(_address)]
User = Annotated[str, AfterValidator(_user)]
HostKey = Annotated[str, AfterValidator(_host_key)]
Port = Annotated[int, Field(ge=1, le=65535)]
Seconds = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]
Env = Annotated[dict[EnvName, EnvValue], AfterValidator(_env_keys)]
