"""``python3 -m capsa.guest``: run the guest daemon."""

from __future__ import annotations

import sys

from capsa.guest.daemon import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
