"""Diagnosis of a failing check: which known fault explains the kernel's output, and where the
error concentrates (``explain``), so that a FAIL names its most likely cause, not only a ratio."""
