"""The rollout manager (DESIGN §1, §4, §5): the cluster's control view. For now it owns the relay
chain (chain.py: logic; chain_host.py: its execution over the bus); repack comes later."""
