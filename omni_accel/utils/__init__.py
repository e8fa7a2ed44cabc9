"""Small utilities shared across the package (logging)."""
