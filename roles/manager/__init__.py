"""The rollout manager (docs/architecture.md §2, §6, §7, §10): the cluster's control view: the relay
chain (chain.py: logic; chain_host.py: its execution over the bus), the fleet view and dynamic repack
(repack.py: planning; fleet.py: execution), dead-rollout recovery and group accounting."""
