"""Drafter files: SGLang export / DeepSpec import and validation (``checkpoint``,
``checkpoint_v4``), the reduced draft vocabulary (``draft_vocab``)."""
