"""The demo model's tokenizer: a byte-level BPE trained on ``runtime/_corpus.txt``, with ChatML.

``runtime.default_model`` builds the demo model folder; this module makes its
``tokenizer.json`` (``train_tokenizer``) and ``tokenizer_config.json`` (``tokenizer_config``,
which carries ``CHAT_TEMPLATE``). Both are deterministic: the same corpus gives the same files.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from phloem.runtime._default_model_weights import MAX_LEN

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TARGET_VOCAB", "tokenizer_config", "train_tokenizer"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# The BPE trainer's vocab size; the model's embedding rows round the trained size up to 64.
TARGET_VOCAB = 2000

# ChatML as Qwen renders it, with tools in the system turn, <tool_call> JSON in assistant turns
# and tool results as <tool_response> blocks inside one user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- (messages[0].content or '') + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are in <tools></tools>:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments in"
    " <tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\":"
    " <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + (messages[0].content or '') + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE of about ``TARGET_VOCAB`` tokens, ``SPECIAL_TOKENS`` included, trained on
    the packaged corpus (deterministic)."""
    corpus = resources.files("phloem.runtime").joinpath("_corpus.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 byte symbols, so any UTF-8 text encodes (and round-trips) whatever the corpus.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(), trainer=trainer)
    return tokenizer


def tokenizer_config(special: dict[str, int]) -> dict[str, Any]:
    """The ``tokenizer_config.json`` content, given each special token's id in the trained vocab."""
    added = {
        str(token_id): {
            "content": token,
            "special": True,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "single_word": False,
        }
        for token, token_id in special.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MAX_LEN,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
