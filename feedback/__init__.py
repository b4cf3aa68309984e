"""specloop feedback."""
