"""The agent role: runs an agent program per episode, in the sandbox, against the gateway."""
