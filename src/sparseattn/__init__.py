"""sparseattn: hardware-efficient sparse attention research toolkit."""

__version__ = "0.1.0"
