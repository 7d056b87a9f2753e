"""RL losses of the trainer (DESIGN §6): GRPO with Clip-Higher (grpo.py), PPO's GAE and value loss (ppo.py)."""
