"""Scripts run by path (``python3 benchmarks/sweeps/NAME.py``), mostly on a GPU: kernel launch
configuration sweeps that pass their tiles and ``KernelConfig`` in, step traces and profiles, and
CPU benchmarks of the radix cache. Nothing imports them; they import the product like any client.
"""
