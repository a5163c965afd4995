"""Model definitions, keyed by the Hugging Face ``architectures`` name."""
