"""Audits of the harness and of the backends beyond one verdict per case: the oracle's
self-check (``selfcheck``), benchmarks that print tables (``bench``), the memory that padding costs
(``padding_audit``), the fault catalogue's run (``catalogue``) and mutation of real vendor
kernels (``mutation``)."""
