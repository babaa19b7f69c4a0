"""cachecraft policy."""
