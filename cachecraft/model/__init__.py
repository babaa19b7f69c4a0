"""cachecraft model."""
