"""The gateway role: an OpenAI-compatible HTTP endpoint; each call is a turn of an agent episode on its rollout."""
