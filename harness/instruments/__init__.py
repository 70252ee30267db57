"""The harness's own backends, which exist to test the harness rather than to be tested by it:
the torch layer every one of them is built on (``torch_moe``), the honest variants that must never
fail (``honest``) and the catalogue of planted faults that must always be caught (``faults``)."""
