"""RL losses of the trainer (docs/architecture.md §9; docs/learning.md): GRPO's advantages and the
clipped policy loss both algorithms use (grpo.py), PPO's GAE, value loss and critic (ppo.py)."""
