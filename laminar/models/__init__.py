"""Models: the tiny local test model and loading of local Hugging Face causal LMs."""
