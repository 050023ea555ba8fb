"""CLI: python -m perfmodel predict|validate|floor|search|calibrate|emulate (see perfmodel/README.md)."""
import sys

from perfmodel.cli import main

if __name__ == "__main__":
  sys.exit(main())
