"""The prompt pool: hands out GRPO groups of a local dataset, with a cursor that survives restarts."""
