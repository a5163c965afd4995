"""The ``phloem`` command: the composition root, the top layer.

Role: parse flags and ``PHLOEM_*`` variables into one ``ServerConfig`` (``cli.config``, made
of each layer's section; the flag table ``cli.options``) and wire the layers together:
``phloem serve`` (``cli.main``, then the composition root ``cli.compose``: engine client,
tokenizer, sessions and the HTTP app), ``phloem demo`` (the SDK against a server, ``cli.demo``)
and ``phloem bench`` (``phloem.benchmarks``). ``cli.parsers`` holds the argparse helpers.

May import: every other package (``phloem.benchmarks``, ``phloem.api``, ``phloem.sessions``,
``phloem.runtime``, ``phloem.engine``, ``phloem.storage``); nothing imports it. Heavy imports
(torch, the server, the SDK) happen inside the function that needs them, so ``phloem --help``
stays fast and never imports torch.
"""
