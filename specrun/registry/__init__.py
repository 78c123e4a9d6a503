"""models.toml, the Hugging Face hub, compatibility checks and loading a backend for an alias or a path."""
