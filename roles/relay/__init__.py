"""The relay role (DESIGN §4): one per rollout host; the data plane is laminar/weights/node.py."""
