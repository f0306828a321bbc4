"""DeepSeek-V4: checkpoints and tools for SGLang's V4 path (see ``docs/deepseek-v4.md``)."""
