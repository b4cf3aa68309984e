"""Which target model a drafter or trace belongs to: where it lives, and its fingerprint."""
