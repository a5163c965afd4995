"""Launch helpers the Triton kernels of every op folder share::

    device   the SM count and the balanced grid of the kernels whose programs walk tiles
    pdl      whether a launch uses programmatic dependent launch (on for sm_90+)

Importing this package imports no Triton code.
"""
