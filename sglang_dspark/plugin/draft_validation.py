"""Refuse a draft that does not fit the target at start-up (filled in below)."""

HOOKS: dict = {}
