"""dflashops: declarative deploys of LLM servers and jobs to multi-GPU nodes over SSH."""

__version__ = "0.1.0"
