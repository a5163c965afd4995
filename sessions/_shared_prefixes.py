"""Computing and pinning the operator's shared prefixes at start (``runtime.shared_prefixes``).

Each prefix is turned into token ids (messages: the chat template without a generation prompt;
text: as is), prefilled in the prefix cache's shared namespace (``None``) and pinned for the
server's lifetime, so it is never evicted and every key's requests that begin with it hit it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from phloem.engine import EngineError
from phloem.runtime.shared_prefixes import SharedPrefix
from phloem.sessions.errors import InvalidInput
from phloem.sessions.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from phloem.runtime import EngineClient

__all__ = ["share_prefixes", "shared_prefix_ids"]

logger = logging.getLogger(__name__)


def shared_prefix_ids(tokenizer: Tokenizer, prefix: SharedPrefix) -> list[int]:
    """The token ids of one shared prefix.

    Raises:
        InvalidInput: The chat template rejects its messages, or it renders to nothing.
    """
    if prefix.text is not None:
        ids = tokenizer.encode(prefix.text)
    else:
        assert prefix.messages is not None
        ids = tokenizer.encode(tokenizer.render_text(prefix.messages, tools=prefix.tools))
    if not ids:
        raise InvalidInput("shared prefix: it renders to no tokens")
    return ids


async def share_prefixes(engine: EngineClient, tokenizer: Tokenizer,
                         prefixes: Sequence[SharedPrefix]) -> list[object]:
    """Prefill and pin every prefix in the shared namespace.

    Args:
        engine: The started engine.
        tokenizer: The model's tokenizer.
        prefixes: The operator's prefixes.

    Returns:
        The pins' handles (held for the server's lifetime).

    Raises:
        InvalidInput: A prefix does not render, or does not fit the context window.
        EngineError: The engine refused it (no room even when empty).
    """
    handles: list[object] = []
    for number, prefix in enumerate(prefixes, start=1):
        ids = shared_prefix_ids(tokenizer, prefix)
        if len(ids) >= engine.max_model_len:
            raise InvalidInput(f"shared prefix {number}: {len(ids)} tokens do not leave room in the "
                               f"context window of {engine.max_model_len} tokens")
        await engine.prefill(ids)
        handle = await engine.pin_prefix(ids)
        if handle is None:
            raise EngineError(f"shared prefix {number}: its checkpoint was evicted before it was pinned")
        handles.append(handle)
        logger.info("shared prefix %d: %d tokens, pinned in the shared namespace", number, len(ids))
    return handles
