"""When the controller's journal reaches the disk (``fsync``), by name: ``never`` (the OS
decides), ``batch`` (once per batch of changes) or ``always`` (every change). The names
without the journal, so that a config checks them without loading the store's modules."""

__all__ = ["FSYNC_POLICIES"]

FSYNC_POLICIES = ("never", "batch", "always")
