"""Laminar: trajectory-level asynchronous RL post-training for LLMs (see README.md and docs/architecture.md)."""

__version__ = "0.1.0"
