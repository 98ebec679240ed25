"""What units stand on, made so on one host before any unit starts: environments first, then
files entries in playbook order (DESIGN.md "Node state"). Used by deploy.py's HostRun.deploy.

Every step is judged from the one facts call (its ``files`` and ``envs`` parts): an entry whose
dest already holds its source, an environment whose build is in place, costs nothing more.
What remains: one ``build`` call for the environments (after their inputs are shipped), and per
entry one transfer: ``receive`` (controller sources and relays), ``copy`` (same-host paths and
hub repositories). Relayed entries first ``pull`` from their source host into the controller's
cache, verified, then go out like controller files.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflashops.agent import Agent
from dflashops.agent.answers import FileState, HostFacts, JobState
from dflashops.agent.transfer import Transfer, diff, human, listing, pull, space_problem, upload
from dflashops.cache import cache_dir
from dflashops.errors import DflashopsError, HostError
from dflashops.lifecycle.session import HostSession
from dflashops.plan.nodestate import EnvPlan, FilePlan, NodeState, local_scan

State = Literal["ok", "changed", "waiting", "failed"]
COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Change:
    """What one step decided to change: ``would`` says it (--check), ``apply`` makes it. The
    step judges the same way with or without --check; only ``Stage.carry_out`` tells them
    apart."""

    would: Callable[[], None]
    apply: Callable[[], None]


@dataclass
class Stage:
    """The step on one host's session; ``check``: say what would change, change nothing;
    ``abort``: raises between steps once the run is interrupted; ``failed``: the run's failed
    names, which this step adds its environments and entries to."""

    session: HostSession
    node: NodeState
    facts: HostFacts
    check: bool = False
    abort: Callable[[], None] = lambda: None
    failed: set[str] = field(default_factory=set)
    envs_failed: dict[str, str] = field(default_factory=dict)  # env -> why
    entries: dict[str, State] = field(default_factory=dict)  # files key -> outcome
    reasons: dict[str, str] = field(default_factory=dict)  # files key -> why waiting/failed
    digests: dict[str, str | None] = field(default_factory=dict)  # files key -> dest digest
    targets: dict[str, str | None] = field(default_factory=dict)  # files key -> source digest

    def expected(self, key: str) -> str | None:
        """What the entry's dest holds after this deploy (with --check: will hold)."""
        return self.digests.get(key)

    def carry_out(self, change: Change | None) -> None:
        """The one place --check is read: say the change, or make it."""
        if change is not None:
            (change.would if self.check else change.apply)()

    builder: Agent | None = None  # the environments' own agent while they build beside files

    @property
    def agent(self) -> Agent:
        return self.session.agent

    def both(self) -> None:
        """Environments, then files entries, made so; at once when both have work to do.
        They are independent until units start, so an environment building from wheels
        and a model staged to the RAM disk share the wait instead of adding theirs up. The
        environments get an agent of their own (its calls are channels of their own on the
        same connection): the session's kept agent answers one call at a time."""
        building = not self.check and any(self._to_build())
        staging = any(True for _ in self.node.files)
        if not (building and staging):
            self.environments()
            self.files()
            return
        self.builder = Agent(self.session.conn, self.session.host.python)
        failure: list[BaseException] = []

        def build() -> None:
            try:
                self.environments()
            except BaseException as exc:  # raised here, in the step's own thread, after files
                failure.append(exc)

        thread = threading.Thread(target=build, name=f"build-{self.session.host.name}")
        thread.start()
        try:
            self.files()
        finally:
            thread.join()
            self.builder = None
        if failure:
            raise failure[0]

    def _to_build(self) -> list[EnvPlan]:
        states = {env.name: self.facts.envs.get(env.name) for env in self.node.envs.values()}
        return [
            env
            for env in self.node.envs.values()
            if (state := states[env.name]) is None or state.state not in ("ok", "unmanaged")
        ]

    # -- environments --------------------------------------------------------------------------

    def environments(self) -> None:
        todo = []
        for env in self.node.envs.values():
            state = self.facts.envs.get(env.name)
            if state is not None and state.state == "ok":
                self._env_event(
                    env, "ok", f"environment {env.name} ok ({env.path}, build {env.hash[:12]})"
                )
                continue
            if state is not None and state.state == "unmanaged":
                self._env_failed(
                    env,
                    f"{env.path} exists and is not an environment dflashops manages: move it aside or choose another `path`; nothing was changed",
                )
                continue
            todo.append(env)
        if todo:
            self.carry_out(
                Change(
                    would=lambda: self._would_build(todo),
                    apply=lambda: self._build(todo),
                )
            )

    def _would_build(self, todo: list[EnvPlan]) -> None:
        for env in todo:
            what = ", ".join(env.spec.packages) or "requirements"
            extra = f" and {len(env.inputs)} shipped input file(s)" if env.inputs else ""
            self._env_event(
                env,
                "changed",
                f"environment {env.name} would be built at {env.path} (build {env.hash[:12]}: {what}{extra}){self._broken(env)}",
            )

    def _build(self, todo: list[EnvPlan]) -> None:
        self.abort()
        specs = []
        for env in todo:
            try:
                specs.append(self._env_spec(env))
            except DflashopsError as exc:
                self._env_failed(env, exc.message_for(self.session.host.name))
        results = (self.builder or self.agent).build(self.session.workdir, specs)
        for env in todo:
            res = results.get(env.name)
            if env.name in self.envs_failed:
                continue
            if res is None or not res.ok:
                why = res.error if res is not None else "no answer"
                self._env_failed(
                    env,
                    f"build failed; the previous build (if any) and everything running on it are untouched:\n{why}",
                )
                continue
            how = (
                f"built with {res.installer} in {res.seconds:.0f}s"
                if res.built
                else "switched to an earlier build"
            )
            found = f": {res.note}" if res.note else self._broken(env)
            self._env_event(
                env,
                "changed",
                f"environment {env.name} {how} ({env.path}, build {env.hash[:12]}){found}",
            )

    def _broken(self, env: EnvPlan) -> str:
        """Why the build in place is rebuilt though its content did not change, or ''."""
        state = self.facts.envs.get(env.name)
        return f": {state.note}" if state is not None and state.note else ""

    def _env_spec(self, env: EnvPlan) -> dict[str, Any]:
        """Ship the environment's inputs (requirements file, wheels) and say where they are."""
        spec: dict[str, Any] = {
            "name": env.name,
            "path": env.path,
            "hash": env.hash,
            "python": env.python,
            "packages": env.spec.packages,
        }
        if not env.inputs:
            return spec
        inputs = env.inputs_dir(self.session.workdir)
        local = self._inputs_folder(env)
        agent = self.builder or self.agent
        have = agent.scan(self.session.workdir, inputs, cache="dest").tree
        if have is None:
            raise HostError(self.session.host.name, f"the scan of {inputs} answered without it")
        plan = diff(dict(env.inputs.items()), listing(have.files), have.parts, delete=True)
        if not plan.empty:
            res = upload(agent, self.session.workdir, inputs, local, plan, None)
            if not res.ok:
                raise HostError(
                    self.session.host.name,
                    f"shipping the inputs of environment {env.name} failed: {res.error or res.failed}",
                )
        if env.requirements is not None:
            spec["requirements"] = f"{inputs}/requirements.txt"
        if env.wheels is not None:
            spec["wheels"] = f"{inputs}/wheels"
        return spec

    def _inputs_folder(self, env: EnvPlan) -> Path:
        """The inputs as one local folder (requirements.txt, wheels/), by links into the
        controller's cache: upload sends from a single root."""
        folder = cache_dir() / "env-inputs" / env.hash[:16]
        (folder / "wheels").mkdir(parents=True, exist_ok=True)
        if env.requirements is not None:
            _link(folder / "requirements.txt", env.requirements)
        if env.wheels is not None:
            for rel in env.inputs:
                if rel.startswith("wheels/"):
                    _link(folder / rel, env.wheels / rel.removeprefix("wheels/"))
        return folder

    def _env_failed(self, env: EnvPlan, why: str) -> None:
        self.envs_failed[env.name] = why
        self.failed.add(f"environment:{env.name}")
        self._env_event(env, "failed", f"environment {env.name}: {why}")

    def _env_event(self, env: EnvPlan, status: str, message: str) -> None:
        self.session.emit(None, status, "environment", message, entry=f"env:{env.name}")

    # -- files -----------------------------------------------------------------------------------

    def files(self) -> None:
        for f in self.node.files:
            self.abort()
            state = self.facts.files.get(f.key)
            if state is None:
                self._entry(f, "failed", "facts did not report this entry")
                continue
            self.digests[f.key] = state.digest
            try:
                if not self._after_done(f):
                    continue
                judge = {
                    "controller": self._controller,
                    "host": self._host,
                    "hf": self._hub,
                    "relay": self._relay,
                }[f.kind]
                self.carry_out(judge(f, state))
            except DflashopsError as exc:
                self._entry(f, "failed", exc.message_for(self.session.host.name))

    def _entry(self, f: FilePlan, outcome: State, message: str, **data: Any) -> None:
        self.entries[f.key] = outcome
        if outcome in ("waiting", "failed"):
            self.reasons[f.key] = message
        status = {"ok": "ok", "changed": "changed", "waiting": "waiting", "failed": "failed"}[
            outcome
        ]
        if outcome == "failed":
            self.failed.add(f"files:{f.key}")
        self.session.emit(
            None, status, "files", f"{f.label} -> {f.dest}: {message}", entry=f.key, **data
        )

    def _change(self, f: FilePlan, would: str, apply: Callable[[], None], **data: Any) -> Change:
        """The entry's change; said under --check, the dest counts as holding the source."""

        def say() -> None:
            self.digests[f.key] = self.targets.get(f.key)
            self._entry(f, "changed", would, **data)

        return Change(would=say, apply=apply)

    def _after_done(self, f: FilePlan) -> bool:
        if f.entry.after_parts is None:
            return True
        host, job = f.entry.after_parts
        peer = self.session.peer(host)
        found = peer.scan(self.session.peer_workdir(host), None, job=job)
        state = found.job or JobState(state="never")
        if state.state == "done":
            return True
        if state.state == "failed":
            code = (state.exit or {}).get("code")
            self._entry(
                f,
                "failed",
                f"{host}/{job} failed (exit {code}): nothing is copied from a failed job; fix it and run it again",
            )
            return False
        self._entry(
            f, "waiting", f"waiting for {host}/{job} ({state.state}{progress_text(state.progress)})"
        )
        return False

    def _send(
        self, f: FilePlan, state: FileState, local: Path, src: dict[str, tuple[int, str | None]]
    ) -> Change | None:
        plan = diff(src, listing(state.files), state.parts or {}, f.entry.delete)
        if plan.empty:
            self._entry(f, "ok", f"ok ({len(src)} file(s))")
            return None
        if (why := space_problem(plan.bytes, state, f.dest)) is not None:
            self._entry(f, "failed", why)
            return None
        return self._change(
            f,
            f"would send {moving(plan)}",
            lambda: self._upload(f, local, plan),
            bytes=plan.bytes,
            files=len(plan.send),
        )

    def _upload(self, f: FilePlan, local: Path, plan: Transfer) -> None:
        res = upload(self.agent, self.session.workdir, f.dest, local, plan, f.entry.mode_bits)
        self.digests[f.key] = res.digest
        if not res.ok:
            failed = "; ".join(f"{rel or f.dest}: {why}" for rel, why in res.failed.items())
            self._entry(
                f,
                "failed",
                f"{res.error or failed} ({len(res.written)} of {len(plan.send)} file(s) arrived and are in place)",
            )
            return
        self._entry(f, "changed", f"sent {moving(plan)}", bytes=plan.bytes, files=len(plan.send))

    def _controller(self, f: FilePlan, state: FileState) -> Change | None:
        assert f.local is not None
        scanned = local_scan(f.local)
        src = listing(scanned["files"])
        self.targets[f.key] = scanned["digest"]
        if state.digest is not None and state.digest == scanned["digest"]:
            self._entry(f, "ok", f"ok ({len(src)} file(s))")
            return None
        return self._send(f, state, f.local, src)

    def _host(self, f: FilePlan, state: FileState) -> Change | None:
        src = state.src
        self.targets[f.key] = src.digest if src is not None else None
        if src is not None and not src.exists:
            self._entry(
                f, "failed", f"the source {f.src} does not exist on {self.session.host.name}"
            )
            return None
        if src is not None and src.digest is not None and src.digest == state.digest:
            self._entry(f, "ok", f"ok (same as {f.src})")
            return None
        size = f", {human(src.bytes)} in the source" if src is not None else ""
        return self._change(
            f, f"would copy what differs from {f.src}{size}", lambda: self._copy(f, src=f.src)
        )

    def _hub(self, f: FilePlan, state: FileState) -> Change | None:
        origin = state.origin or {}
        pinned = f.revision is not None and COMMIT_RE.fullmatch(f.revision) is not None
        if (
            pinned
            and origin.get("repo") == f.src
            and origin.get("commit") == f.revision
            and origin.get("digest") == state.digest
        ):
            self._entry(f, "ok", f"ok (hf {f.src}@{f.revision[:12]})")  # type: ignore[index]
            return None
        return self._change(
            f,
            f"would download hf {f.src}@{f.revision or 'main'} on the host and copy what differs",
            lambda: self._download(f),
        )

    def _download(self, f: FilePlan) -> None:
        resolved = self.session.resolved  # the run's secrets, registered for redaction once
        missing = [v for v in f.entry.secret_env.values() if v not in resolved.values]
        if missing:
            self._entry(f, "failed", f"secret_env needs {', '.join(missing)} set on the controller")
            return
        secrets = {k: resolved.values[v] for k, v in f.entry.secret_env.items()}
        self._copy(f, hub={"repo": f.src, "revision": f.revision}, secrets=secrets)

    def _copy(self, f: FilePlan, **how: Any) -> None:
        res = self.agent.copy(
            self.session.workdir, f.dest, delete=f.entry.delete, mode=f.entry.mode_bits, **how
        )
        self.digests[f.key] = res.digest
        if not res.ok:
            self._entry(f, "failed", hub_hint(res.error or "copy failed", f))
            return
        if not res.copied and not res.deleted:
            self._entry(f, "ok", "ok (nothing differed)")
            return
        self._entry(
            f,
            "changed",
            f"copied {len(res.copied)} file(s), {human(res.bytes)}"
            + (f", deleted {len(res.deleted)}" if res.deleted else ""),
            bytes=res.bytes,
            files=len(res.copied),
        )

    def _relay(self, f: FilePlan, state: FileState) -> Change | None:
        assert f.src_host is not None
        peer = self.session.peer(f.src_host)
        found = peer.scan(self.session.peer_workdir(f.src_host), f.src).tree
        if found is None or not found.exists:
            self._entry(f, "failed", f"the source {f.src_host}:{f.src} does not exist")
            return None
        src = listing(found.files)
        self.targets[f.key] = found.digest
        if state.digest is not None and state.digest == found.digest:
            self._entry(f, "ok", f"ok (same as {f.src_host}:{f.src})")
            return None
        plan = diff(src, listing(state.files), state.parts or {}, f.entry.delete)
        return self._change(
            f,
            f"would relay {moving(plan)} from {f.src_host} through the controller",
            lambda: self._pull_and_send(f, state, src),
            bytes=plan.bytes,
        )

    def _pull_and_send(
        self, f: FilePlan, state: FileState, src: dict[str, tuple[int, str | None]]
    ) -> None:
        assert f.src_host is not None
        staging = relay_dir(f)
        private(staging)
        _, failed = pull(
            self.session.peer(f.src_host),
            self.session.peer_workdir(f.src_host),
            f.src,
            src,
            staging,
            timeout=6 * 3600,
        )
        if failed:
            shown = "; ".join(f"{rel or f.src}: {why}" for rel, why in list(failed.items())[:3])
            self._entry(
                f, "failed", f"relay from {f.src_host} incomplete ({len(failed)} file(s)): {shown}"
            )
            return
        if (send := self._send(f, state, staging, src)) is not None:
            send.apply()  # pulled: the same judgement as a controller source, then made
        if self.entries.get(f.key) in ("ok", "changed"):
            # Verified on the host: the copy here is spent (a failed upload keeps it to resume).
            shutil.rmtree(staging, ignore_errors=True)


def progress_text(progress: dict[str, Any] | None) -> str:
    if not progress:
        return ""
    done, total = progress.get("done"), progress.get("total")
    return f", {done}/{total} done" if done is not None and total else ""


def moving(plan: Transfer) -> str:
    text = f"{len(plan.send)} file(s), {human(plan.bytes)}"
    resumed = sum(1 for *_, offset in plan.send if offset)
    if resumed:
        text += f" ({resumed} resumed)"
    if plan.delete:
        text += f", delete {len(plan.delete)}"
    return text


def hub_hint(error: str, f: FilePlan) -> str:
    if f.kind == "hf" and ("gated" in error.lower() or "401" in error) and not f.entry.secret_env:
        error += "\n  a gated repo needs a token: add `secret_env: {HF_TOKEN: HF_TOKEN}` to this entry and export HF_TOKEN on the controller"
    return error


def relay_dir(f: FilePlan) -> Path:
    key = hashlib.sha256(f"{f.src_host}:{f.src}".encode()).hexdigest()[:16]
    return cache_dir() / "relay" / f"{f.src_host}-{key}"


def private(folder: Path) -> None:
    """``folder`` and the relay cache holding it, readable by the operator only (0700): what a
    relay stages may be anything (weights, data sets, a gated model)."""
    folder.parent.parent.mkdir(parents=True, exist_ok=True)
    for path in (folder.parent, folder):
        path.mkdir(mode=0o700, exist_ok=True)
        path.chmod(0o700)


def _link(path: Path, target: Path) -> None:
    """``path`` names ``target``'s content (a hard link, else a copy): never a stale one."""
    if path.exists() and os.path.samefile(path, target):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # Hosts stage the same inputs from their own threads: the name is the thread's, not the pid's.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(target, tmp)
    except OSError:
        shutil.copy2(target, tmp)
    os.replace(tmp, path)
