"""`v4_foreign_tokenizer_chat`: a DeepSeek-V4 checkpoint with another tokenizer keeps its own
chat template.

SGLang picks a chat encoder per architecture: any `DeepseekV4*` model gets DeepSeek's recipe
renderer (`entrypoints/openai/chat_encoding.py:45`), which encodes DeepSeek's special tokens.
The server encodes a probe conversation at start-up, so a V4 checkpoint with another tokenizer
(the tiny V4, `sglang-dspark setup-tiny-v4`, uses SmolLM2's) cannot start at all: "special
token "<｜begin▁of▁sentence｜>" is not in the added vocabulary"
(`entrypoints/openai/serving_deepseek_recipe.py:74`, from the HTTP server's lifespan).

When the spec comes from the architecture alone (no `--tool-call-parser`) and the tokenizer
has no DeepSeek begin-of-sentence token, the hook answers None: the checkpoint's own chat
template, as for any other model. A checkpoint with DeepSeek's tokenizer is unchanged, so is an
explicit `--tool-call-parser deepseekv4`; the case changed is one where upstream cannot start.
"""

from __future__ import annotations

import logging

from sglang_dspark.plugin.registry import register_around

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.entrypoints.openai.chat_encoding.resolve_chat_encoding_spec"
DEEPSEEK_BOS = "<｜begin▁of▁sentence｜>"
DEEPSEEK_SPECS = ("dsv4", "dsv41")


def has_deepseek_tokens(tokenizer) -> bool:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return tokenizer is None or get_vocab is None or DEEPSEEK_BOS in get_vocab()


def _spec_for_tokenizer(original, *, hf_config, tokenizer, tool_call_parser=None):
    spec = original(hf_config=hf_config, tokenizer=tokenizer, tool_call_parser=tool_call_parser)
    if spec in DEEPSEEK_SPECS and tool_call_parser is None and not has_deepseek_tokens(tokenizer):
        logger.warning(
            "sglang-dspark: this DeepSeek-V4 checkpoint's tokenizer has no %s token; chat "
            "prompts use its own chat template instead of DeepSeek's recipe (%s)",
            DEEPSEEK_BOS, spec,
        )  # fmt: skip
        return None
    return spec


def install() -> None:
    register_around(TARGET, _spec_for_tokenizer)


HOOKS = {"v4_foreign_tokenizer_chat": install}
