"""Desired units from configuration: which unit runs on which host, with which GPUs and port,
after which other units. Pure: no host is contacted, nothing is rendered here.

Service ``NAME`` with ``replicas: N`` becomes units ``NAME-0 .. NAME-(N-1)`` on every targeted
host, replica i on ``port + i``. Jobs keep their name. GPUs are handed out per host: explicit
lists first (they are claims), then ``auto`` services in playbook order, then jobs' GPU counts
from what is left.

A service with ``nodes: [a, b]`` spans hosts: each of them has a part ``NAME-0`` with its rank
(the list's order, head first) and tp*dp/len(nodes) GPUs; only the head has a port.

Modules, in the order a plan is made: ``expand`` ({{ vars }} per host), ``hosts`` (targets, a
multi-node unit's nodes), ``gpus`` (GPUs per replica, the allocator), ``units`` (what one entry
makes on one host, Ray parts included), ``links`` (needs, servers, environments, files),
``checks`` (names, ports, cycles, vLLM DP; the start order), ``build`` (all of it per host);
``model`` holds the values.
"""

from dflashops.engines.protocol import DEFAULT_PORTS
from dflashops.plan.build import build_plan
from dflashops.plan.checks import DP_ADVICE, topo_order
from dflashops.plan.gpus import gpus_of, parallelism
from dflashops.plan.hosts import targets
from dflashops.plan.model import HostPlan, Plan, Spec, Unit, Where

__all__ = [
    "DEFAULT_PORTS",
    "DP_ADVICE",
    "HostPlan",
    "Plan",
    "Spec",
    "Unit",
    "Where",
    "build_plan",
    "gpus_of",
    "parallelism",
    "targets",
    "topo_order",
]
