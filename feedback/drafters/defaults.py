"""The day-0 self-speculative drafter's shape, named once: serving builds its day-0 drafter with it
and the trainer its day-0 student, so the champion a first candidate is judged against is the
drafter serving runs (serving's read 16,384 lm_head rows where the trainer's student read 8,192).
No torch here: settings modules import it."""

SELFSPEC_EXIT_LAYER = 2
"""Target layers the drafter shares before its trainable adapter."""
SELFSPEC_ADAPTER_LAYERS = 1
"""Trainable adapter layers after the shared ones."""
SELFSPEC_DRAFT_VOCAB_SIZE = 8192
"""lm_head rows a draft reads (the lowest ids plus the tokenizer's specials): what the demo and the
pre-study measured (feedback/drafters/vocab.py ``day0_draft_vocab``)."""
