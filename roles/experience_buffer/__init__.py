"""The experience buffer: finished, scored trajectories kept as whole GRPO groups until trained on."""
