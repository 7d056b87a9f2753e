"""The rollout role: one vLLM engine, token ids in and out, one weight version at a time."""
