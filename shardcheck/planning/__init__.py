"""The plan report: what CP hints make each rank compute on its slice, and what it costs.

Pure functions over a graph index and hints (no files, no printing): ``plan.make_plan`` counts
the figures, ``report`` words them, ``picture`` draws them.
"""
