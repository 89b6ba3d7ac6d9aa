"""bimetal's release version: one place, read by the package (``bimetal.__version__``) and by the rank records
that compare it across ranks at start-up (``bimetal.topology.versions``), which must not import the package
root (it registers the transports)."""

__version__ = "0.1.0"
