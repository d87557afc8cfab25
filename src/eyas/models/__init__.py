"""The target's own code eyas runs outside transformers: the lean Llama-family decoder, the feature hooks."""
