"""The dflashops host agent: stdlib-only Python 3.9+ code that runs on the GPU host.

Never installed there. For each call the controller bundles this package into one file
(``dflashops.agent.bundle``) and pipes it to the host's python with the request; the unit
supervisor runs from a content-addressed copy of that same file that ``start`` leaves under
``WORKDIR/agent/``. Modules import each other relatively, so the controller's tests import them
as ``dflashops.agent.remote.*`` and the host imports them as ``dflashops_agent.*``.

One module per helper: ``common`` (JSON files, small utilities), ``layout`` (the workdir's
file names, shared with the controller), ``verified`` (the one verified writer), ``procfs``
(/proc), ``gpu`` (nvidia-smi), ``ownership`` (is this process the unit we started), ``logs``;
one per action: ``facts``, ``start``, ``stop``, ``probe``, ``tail``, ``write``; ``supervisor``
is the unit's session leader; ``main`` parses the request and dispatches.
"""

BUNDLE = ""  # the bundle's own text, set by its bootstrap on the host (start copies it to disk)
