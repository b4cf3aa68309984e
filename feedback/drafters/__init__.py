"""Learned drafter definitions shared by serving (drafting) and the trainer (distillation), and the registry of kinds."""
