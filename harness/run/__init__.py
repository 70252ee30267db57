"""Running many checks: the registry of backends (``registry``), the named case profiles
(``profiles``), the crash-proof multi-process sweep (``sweep``) and the results it records
(``results``)."""
