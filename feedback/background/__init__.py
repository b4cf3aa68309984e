"""Background work that must never hold up decoding: supervised loops and per-thread priority."""
