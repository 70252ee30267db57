"""``python -m harness``: one module per command (each adds its own subparsers), argument types in
``args``, the table printer in ``tables``; ``main`` builds the parser from them."""
