"""The partial response pool: tokens and logprobs of every in-flight trajectory, durable."""
