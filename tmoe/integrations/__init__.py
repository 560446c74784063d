"""Drop-in integrations with model libraries (optional dependencies)."""
