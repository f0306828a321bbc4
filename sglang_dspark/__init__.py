"""sglang-dspark: train, calibrate, serve and load-test DSpark drafters on SGLang 0.5.23."""

__version__ = "0.1.0"
SGLANG_VERSION = "0.5.23"
