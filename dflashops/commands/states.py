"""Every state `status` (and `top`) can show, explained once: ``LEGEND`` is the text of
`status --help` and of the operations guide's list. No imports, so that help costs nothing.

``STYLE`` is the colour of each state in both tables; a state not in it is shown red (it needs
someone: dead, failed, crashed, drifted, unreachable, ...)."""

LEGEND = """\
states (the state column; `status --json` gives the same words):
  ready           a service that answers its health check (HTTP 200) and runs what its playbook
                  renders (fingerprint and the server's own settings agree)
  starting        a service whose process runs but whose health check does not answer 200 yet
  running         a job, or a unit without a health check, whose process runs; also any unit
                  whose playbook does not load: its health is then not probed
  restarting      it crashed or failed liveness; its supervisor starts it again after a backoff
                  (and once the GPUs it held are free)
  crashed         its supervisor gave up: more restarts than restart_limit allows; it stays down
                  until `deploy` starts it
  dead            a service whose process ended without a stop, and no supervisor restarts it
  done            a job that ended with exit 0
  failed          a job that ended with a non-zero exit (its log's end is shown below the table);
                  for a host: it answered but the work could not be done there (its `python:`
                  is missing, another actor holds its deploy lock): the line under the table
                  says why
  drifted         a ready server that says it runs other settings than rendered (tp, dp, model)
  outdated        it runs an older rendering of its playbook: `deploy` restarts it
  stopped         stopped by `dflashops stop`, or deployed and not started since; folder and
                  logs are kept
  absent          its playbook defines it, and nothing of it was ever deployed on this host
  waiting         deploy holds it back until what it needs (needs:, an environment, files) is
                  ready
  orphan          dflashops started it on this host and no playbook defines it there any more:
                  `deploy --prune` or `stop --unit NAME` ends it
  unreachable     the host did not answer (address, port, sshd, host key, login): the line
                  under the table says why
  rolled back     `dflashops rollback` put it back on a kept revision (the health column names
                  it: revision N, playbooks differ); the next `deploy` re-applies the playbooks
                  and says so first
  lost            `watch` has not reached the host for longer than --lost-after (watch's own
                  word: it says it on its line and in its host_lost notice)
  re-provisioned  the host's workdir lost the node id it had when last seen (emptied, or
                  another machine under its name; often a new key and port too): a line under
                  the table says so until `deploy` gives it a new id and starts its units

columns:
  uptime          of its current run: a restart by its supervisor starts it again
  restarts        restarts its supervisor began since the unit was started by a deploy (one
                  under way counts: `restarting` with `restart 1` shows 1)
  last exit       how its process last ended, kept until the next exit or a new start by a
                  deploy: exit code, signal, why (liveness, stop) and how long ago

lines under the table, per host, against what the controller saw last (`status --json`:
hosts[].identity is same, rebooted, re-provisioned or first-seen):
  rebooted        its boot id changed: processes and /dev/shm are gone; `deploy` starts what
                  is down (said once)
  re-provisioned  see above (said until a deploy)
"""

STYLE = {
    "ready": "green",
    "running": "green",
    "done": "green",
    "starting": "yellow",
    "outdated": "yellow",
    "rolled back": "yellow",
    "restarting": "yellow",
    "waiting": "cyan",
    "stopped": "dim",
    "absent": "dim",
    "orphan": "magenta",
}
