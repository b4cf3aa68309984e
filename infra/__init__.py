"""specloop infra."""
