"""Model resolution: HF repo ids, local directories and bundled models."""
