"""``python -m mpx.diagnose``: the precision diagnostics on a small built-in model.

Writes a Figure-3-style magnitude histogram, a heat map of flushed fractions
per module and a loss-scale trajectory as PNGs, and prints the recommended
static scale and the non-finite locator's report. ``--help`` lists the
options and their defaults. The PNGs need matplotlib
(``pip install "mpx-mixed-precision[plots]"``); without it the text report is
printed all the same (``--plots always`` makes a missing matplotlib an error).
"""

from mpx.demo._diagnose import main

if __name__ == "__main__":
  main()
