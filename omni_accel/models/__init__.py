"""Native transformers and the registry that selects them by Diffusers class."""
