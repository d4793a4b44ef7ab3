"""Private implementation modules of mpx; import from :mod:`mpx` instead."""
