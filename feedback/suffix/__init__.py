"""The suffix drafter without torch: suffix automata, best-first token trees, and proposals per tenant."""
