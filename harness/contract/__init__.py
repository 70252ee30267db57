"""The contract between the harness and a backend: what a case is (``cases``), the inputs it
makes (``inputs``), the protocol a backend implements and the declaration it makes (``backend``),
the conversions and padding a backend may ask for (``convert``, ``padding``) and the platforms it
may run on (``platforms``). Everything above builds on these; they import nothing of the harness
but the reference."""
