"""dflashops engine_args: ask an installed engine's own parser to judge command lines.

    python engine_args.py < REQUEST        (or ``python -c "$(cat engine_args.py)"``)

REQUEST (JSON on stdin): ``{"engines": {"sglang": [ARGV, ...], "vllm": [ARGV, ...]}}``, each
ARGV a list of strings: what follows ``python -m sglang.launch_server`` for SGLang, what follows
``vllm serve`` (the model first) for vLLM; ``"options": true`` adds each parser's option
strings to its answer (``options``). One line of JSON on stdout answers:

    {"engines": {ENGINE: {"status": S, "version": V, "error": E, "lines": [VERDICT, ...]}},
     "python": EXECUTABLE}

- ``status`` ``parsed``: the engine imported and its parser judged every line; ``lines`` holds
  one ``{"ok": true}`` or ``{"ok": false, "error": "<the engine's own message>"}`` per ARGV.
- ``cannot-import``: the engine (or something its parser needs) does not import; ``error`` is
  the import error. A unit using it cannot start either.
- ``no-entry-point``: the engine imports but the parser entry points this file knows are not
  there (another layout of that version); ``error`` says which. The caller falls back to its
  flag list and says so.

Parse only: no model is loaded, no GPU touched, no server started. Strict where argparse is
lenient: a flag the parser would take only as an abbreviation of a longer one (``--tp`` for
``--tp-size``) is rejected. SGLang: ``ServerArgs`` through ``prepare_server_args``, then the
speculative algorithm through ``SpeculativeAlgorithm.from_string``. vLLM: the ``serve``
subcommand's parser (``ServeSubcommand.subparser_init``), ``ServeSubcommand.validate`` and
``AsyncEngineArgs.from_cli_args``.

Everything the engines print while importing and parsing goes to stderr (fd 1 is pointed at
fd 2 for that time), so stdout carries only the answer. Stdlib only apart from the engine it
imports; Python 3.9+.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import sys
import time
import traceback

_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class NoEntryPoint(Exception):
    """The engine imports, but not the parser this file knows for it."""


class Rejected(Exception):
    """A line the engine's parser would take but dflashops does not (an abbreviation)."""


def last_lines(text: str, n: int = 3) -> str:
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    return "\n".join(lines[-n:])


def abbreviation(argv: list[str], actions: list[list[str]], normalize: object = None) -> str | None:
    """The first flag of ``argv`` that the parser knows only as a prefix of longer options."""
    options = {o for spellings in actions for o in spellings}
    for token in argv:
        if token == "--":
            break  # positionals from here on
        if not token.startswith("-") or _NUMBER.match(token):
            continue
        key = token.split("=", 1)[0]
        if callable(normalize):
            key = normalize(key)
        if key in options:
            continue
        longer = sorted(o for o in options if o.startswith(key))
        if longer:
            return (
                f"{key} is not a flag of its own: argparse would take it as an abbreviation of "
                f"{' or '.join(longer)}; write the flag in full"
            )
    return None


def option_strings(parser: argparse.ArgumentParser) -> list[list[str]]:
    """Each option's spellings (``--tp-size``/``--tensor-parallel-size``; a generated negation
    such as ``--no-X`` with its ``--X``)."""
    return [list(a.option_strings) for a in parser._actions if a.option_strings]


def verdict(parse: object, argv: list[str]) -> dict[str, object]:
    """One line through the engine: ok, or the engine's own message."""
    caught = io.StringIO()
    try:
        with contextlib.redirect_stderr(caught):
            parse(argv)  # type: ignore[operator]
    except SystemExit as exc:  # argparse's error(): usage and "prog: error: ..." on stderr
        text = caught.getvalue()
        at = text.find(": error: ")
        if at >= 0:
            start = text.rfind("\n", 0, at) + 1
            return {"ok": False, "error": text[start:].strip()}
        why = last_lines(text) or f"the parser exited with status {exc.code} instead of parsing"
        return {"ok": False, "error": why}
    except Rejected as exc:
        return {"ok": False, "error": str(exc)}
    except Exception as exc:  # the engine's own validation (ValueError, AssertionError, ...)
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}".strip()}
    return {"ok": True}


# -- the engines' entry points -----------------------------------------------------------------


def sglang_parser() -> tuple[object, list[list[str]]]:
    try:
        from sglang.srt.server_args import ServerArgs, prepare_server_args
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    except ImportError as exc:
        entry_missing(exc, "sglang")
        raise
    probe = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(probe)
    options = option_strings(probe)

    def parse(argv: list[str]) -> None:
        bad = abbreviation(argv, options)
        if bad:
            raise Rejected(f"sglang serve: error: {bad}")
        args = prepare_server_args(list(argv))
        algorithm = getattr(args, "speculative_algorithm", None)
        if algorithm is not None:
            SpeculativeAlgorithm.from_string(algorithm)

    return parse, options


def _vllm_flag(key: str) -> str:
    """vLLM's parser reads --a_b as --a-b and --json-flag.key as --json-flag."""
    if not key.startswith("--"):
        return key
    return "--" + key[2:].split(".", 1)[0].replace("_", "-")


def vllm_parser() -> tuple[object, list[list[str]]]:
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.cli.serve import ServeSubcommand

        try:
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError:  # before vLLM moved it
            from vllm.utils import FlexibleArgumentParser  # type: ignore[no-redef]
    except ImportError as exc:
        entry_missing(exc, "vllm")
        raise
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    command = ServeSubcommand()
    serve = command.subparser_init(subparsers)
    options = option_strings(serve)

    def parse(argv: list[str]) -> None:
        bad = abbreviation(argv, options, _vllm_flag)
        if bad:
            raise Rejected(f"vllm serve: error: {bad}")
        args = parser.parse_args(["serve", *argv])
        command.validate(args)
        if getattr(args, "model_tag", None) is not None:  # as `vllm serve` itself does
            args.model = args.model_tag
        AsyncEngineArgs.from_cli_args(args)

    return parse, options


PARSERS = {"sglang": sglang_parser, "vllm": vllm_parser}
# Where a machine shows its GPUs (NVIDIA, AMD). Without any, vLLM cannot tell its platform and
# its parser fails to build ("Failed to infer device type"); parsing is the same on its CPU
# platform, which VLLM_TARGET_DEVICE=cpu selects.
GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")


def prepare(engine: str) -> None:
    if (
        engine == "vllm"
        and "VLLM_TARGET_DEVICE" not in os.environ
        and not any(os.path.exists(p) for p in GPU_DEVICES)
    ):
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"


def entry_missing(exc: ImportError, package: str) -> None:
    """A module or name of the engine itself that is not there: no entry point (another
    layout). A third-party module missing is the engine failing to import: re-raised as is."""
    name = getattr(exc, "name", None) or ""
    if name == package or name.startswith(package + ".") or "cannot import name" in str(exc):
        raise NoEntryPoint(f"{type(exc).__name__}: {exc}") from None


def version_of(engine: str, module: object) -> str | None:
    found = getattr(module, "__version__", None)
    if isinstance(found, str) and found:
        return found
    try:
        from importlib import metadata

        return metadata.version(engine)
    except Exception:
        return None


def judge(engine: str, lines: list[list[str]], options: bool = False) -> dict[str, object]:
    out: dict[str, object] = {"status": None, "version": None, "error": None, "lines": []}
    started = time.monotonic()
    try:
        prepare(engine)
        module = importlib.import_module(engine)
        out["version"] = version_of(engine, module)
        if engine not in PARSERS:
            raise NoEntryPoint(f"this dflashops knows no parser for engine {engine!r}")
        parse, known = PARSERS[engine]()
    except NoEntryPoint as exc:
        out["status"] = "no-entry-point"
        out["error"] = (
            f"no parser entry point known for {engine} {out['version'] or '(version unknown)'}: "
            f"{exc}"
        )
    except BaseException as exc:  # anything on import: the engine cannot be imported here
        if isinstance(exc, KeyboardInterrupt):
            raise
        out["status"] = "cannot-import"
        out["error"] = last_lines(traceback.format_exc(), 1) or f"{type(exc).__name__}: {exc}"
    else:
        out["status"] = "parsed"
        out["lines"] = [verdict(parse, [str(t) for t in argv]) for argv in lines]
        if options:
            out["options"] = known
    out["seconds"] = round(time.monotonic() - started, 3)
    return out


def read_request(text: str) -> tuple[dict[str, list[list[str]]], bool]:
    request = json.loads(text)
    engines = request.get("engines") if isinstance(request, dict) else None
    if not isinstance(engines, dict) or not all(
        isinstance(lines, list)
        and all(isinstance(a, list) and all(isinstance(t, str) for t in a) for a in lines)
        for lines in engines.values()
    ):
        raise ValueError('the request must be {"engines": {ENGINE: [[ARG, ...], ...]}}')
    return engines, request.get("options") is True


def main() -> int:
    try:
        engines, options = read_request(sys.stdin.read())
    except ValueError as exc:
        sys.stderr.write(f"engine_args: bad request: {exc}\n")
        return 2
    sys.stdout.flush()
    answer_fd = os.dup(1)
    os.dup2(2, 1)  # the engines' prints and logs: stderr, never the answer
    answer = {
        "engines": {engine: judge(engine, lines, options) for engine, lines in engines.items()},
        "python": sys.executable,
    }
    sys.stdout.flush()
    with os.fdopen(answer_fd, "w") as out:
        out.write(json.dumps(answer, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Engines leave threads and atexit hooks behind on import (vLLM, torch): the answer is
    # out, so nothing they do at exit may hold this process up.
    os._exit(code)
