"""Laminar's roles (docs/architecture.md §2). Each is a `Role` subclass with setup/run/stop, run by laminar/shell.py.

Role modules keep their imports light (torch, vLLM are imported inside `setup`), so that reading
and validating a config never pulls in a heavy framework.
"""
