"""specloop serving."""
