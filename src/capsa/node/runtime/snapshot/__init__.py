"""VM snapshot mechanics (QEMU migration to and from files) and the on-disk snapshot manifest."""
