"""The host agent: ``remote/`` is the code that runs on hosts (stdlib only, bundled per call by
``bundle``); ``client.Agent`` is the controller's one way to call it; ``answers`` types what it
says."""

from dflashops.agent.client import Agent, AgentError

__all__ = ["Agent", "AgentError"]
