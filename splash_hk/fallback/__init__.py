"""Fallback: the decision table and the plain reference attention."""

from splash_hk.fallback.reference import reference_attention
from splash_hk.fallback.selector import select_backend

__all__ = ("reference_attention", "select_backend")
