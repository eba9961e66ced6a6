"""The `draftline` commands, one module per command or family; none imports another (shared helpers are
modules of `cli/`), and `cli/app.py` registers them all."""
