"""``python -m sparseattn``: the same command line as the ``sparseattn`` console script."""

from .cli import main

if __name__ == "__main__":  # not when a spawned worker process imports it
    raise SystemExit(main())
