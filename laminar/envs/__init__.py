"""Environments for multi-turn tasks (base.py), the Python tool sandbox (sandbox.py) and the
Python tool environment (python_tool.py). The `env` role (roles/env) serves them over the bus."""
