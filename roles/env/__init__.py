"""The env role: multi-turn environments (tool sandboxes, verifiers) served to rollouts over the bus."""
