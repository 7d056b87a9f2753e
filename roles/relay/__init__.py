"""The relay role (docs/architecture.md §6): one per rollout host; the data plane is laminar/weights/node.py."""
