"""Running many checks: the registry of backends (``registry``), the named case profiles
(``profiles``), the crash-proof multi-process sweep (``sweep``), the results it records
(``results``), the race hunt's arithmetic (``races``), and the ledger by which pytest-xdist's
workers share a GPU's memory (``ledger``)."""
