"""Drafters behind one protocol (serving/drafters/base.py): suffix, eagle, standalone, hybrid.

``build_drafter(kind, target, artifact_dir=None, **options)`` makes any of them.
"""

from serving.drafters.factory import KINDS, build_drafter

__all__ = ["KINDS", "build_drafter"]
