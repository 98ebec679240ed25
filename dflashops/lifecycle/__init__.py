"""The only controller code that calls a host's agent, one module per part (nothing is
imported here, so that a read-only command loads the session alone, never the executor):

- ``session``: ``HostSession``, a host's connection, agent, workdir, facts and peers (status,
  top and logs use it alone);
- ``secrets``: the run's secrets, read from the controller's environment once and registered
  for redaction once (the decisions that are not I/O, readiness verdicts and start blockers
  among them, are in ``changes/verdicts.py``);
- ``options``: what a changing command is asked to do (``Options``) and ``Interrupted``;
- ``ready``: the readiness wait and its judging, units over several hosts settled;
- ``stage``: environments and files entries on one host before units start;
- ``deploy``: ``HostRun``, deploy, restart-servers and stop.
"""
