"""Token choice from logits.

Torch reference::

    reference       argmax (greedy)

Triton version::

    triton_argmax   argmax

Importing this package imports no Triton code.
"""
