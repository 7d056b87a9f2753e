"""The rollout manager (docs/architecture.md §2, §6, §7, §10): the cluster's control view. For now it owns the relay
chain (chain.py: logic; chain_host.py: its execution over the bus); repack comes later."""
