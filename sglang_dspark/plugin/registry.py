"""Thin wrappers over SGLang's HookRegistry so every hook registers the same way."""

from __future__ import annotations

from collections.abc import Callable

from sglang.srt.plugins.hook_registry import HookRegistry, HookType


def register_replace(target: str, impl: Callable) -> None:
    HookRegistry.register(target, impl, HookType.REPLACE)


def register_around(target: str, hook: Callable) -> None:
    HookRegistry.register(target, hook, HookType.AROUND)


def register_before(target: str, hook: Callable) -> None:
    HookRegistry.register(target, hook, HookType.BEFORE)


def register_after(target: str, hook: Callable) -> None:
    HookRegistry.register(target, hook, HookType.AFTER)
