"""RL losses of the trainer (docs/architecture.md §9; docs/learning.md): GRPO with Clip-Higher (grpo.py), PPO's GAE and value loss (ppo.py)."""
