"""specloop kernels."""
