"""Entry point of ``python -m mpx.demo``."""

import sys

from mpx.demo._cli import main

if __name__ == "__main__":
  sys.exit(main())
