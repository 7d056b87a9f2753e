"""The trainer role (docs/architecture.md §9): GRPO on whole groups from the experience buffer, one version per
global batch, publishing without waiting for the relay tier, atomic checkpoints and resume."""
