"""specloop trainer."""
