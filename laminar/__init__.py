"""Laminar: trajectory-level asynchronous RL post-training for LLMs (see README and DESIGN)."""

__version__ = "0.1.0"
