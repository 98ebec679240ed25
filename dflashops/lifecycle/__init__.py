"""The only controller code that calls a host's agent, one module per part (nothing is
imported here, so that a read-only command loads the session alone, never the executor):

- ``session``: ``HostSession``, a host's connection, agent, workdir, facts and peers (status,
  top and logs use it alone);
- ``verdicts``: decisions that are not I/O (probe specs, unit records, batches, the words);
- ``options``: what a changing command is asked to do (``Options``) and ``Interrupted``;
- ``ready``: the readiness wait and its judging, units over several hosts settled;
- ``stage``: environments and files entries on one host before units start;
- ``deploy``: ``HostRun``, deploy, restart-servers and stop.
"""
