"""Diagnostics: float bits, histograms, range reports, activation taps, the locator, plots."""
