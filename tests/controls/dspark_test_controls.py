"""Test-only negative controls: a rejection sampler broken on purpose, switched per server.

The losslessness tests show that they catch a broken server by breaking one. The switch lives
here, not in the shipped sampler: this folder is an SGLang plugin (`dspark_test_controls`,
declared by the dist-info beside this file) that only test servers load, because only the
tests put the folder on their PYTHONPATH (``server_env``). In-process tests call
``install()``. The shipped sampler (``sglang_dspark.plugin.cpu_sampling``) reads no test
variable.

- ``SGLANG_DSPARK_TEST_BREAK_SAMPLER=MODE`` breaks every CPU verification. Modes
  (``sglang_dspark.verification.rejection.BROKEN_MODES``): ``accept_all`` (every draft kept),
  ``no_renorm`` (the replacement drawn from max(0, p_t - p_d) without renormalising),
  ``bonus_from_draft`` (the bonus token from the last draft distribution), ``ratio_scaled[:C]``
  (acceptance ratio times C, 1.3 by default). An unknown mode raises at the first verification.
- ``SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE=PATH`` reads the mode from PATH at every
  verification instead (missing or empty file: the honest sampler), so one running server can
  be sampled honest and then broken without a second start-up.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

CONTROLS_DIR = Path(__file__).resolve().parent
MODE_ENV = "SGLANG_DSPARK_TEST_BREAK_SAMPLER"
FILE_ENV = "SGLANG_DSPARK_TEST_BREAK_SAMPLER_FILE"


def broken_sampler_mode() -> str | None:
    """The mode asked for now (the file, read now, wins over the variable), validated
    (ValueError names the valid modes)."""
    from sglang_dspark.verification.rejection import parse_broken_mode

    mode = os.environ.get(MODE_ENV) or None
    path = os.environ.get(FILE_ENV)
    if path:
        try:
            mode = Path(path).read_text().strip() or None
        except FileNotFoundError:
            mode = None
    parse_broken_mode(mode)
    return mode


def install() -> None:
    """Route every CPU verification through the switch: DSPARK's verified-rows accept
    (``rejection.chain_accept_verified``), and the chain sampler that DSPARK's accept falls
    back to and the EAGLE/MTP-1 target-only sampler both call
    (``rejection.chain_speculative_sampling_torch``)."""
    from sglang_dspark.verification import rejection

    for name in ("chain_speculative_sampling_torch", "chain_accept_verified"):
        honest = getattr(rejection, name)
        if getattr(honest, "_test_controls", False):
            continue

        def switched(*args, broken=None, _honest=honest, **kwargs):
            return _honest(*args, broken=broken or broken_sampler_mode(), **kwargs)

        functools.update_wrapper(switched, honest)
        switched._test_controls = True
        setattr(rejection, name, switched)


def register() -> None:
    """SGLang's plugin entry point (group ``sglang.srt.plugins``)."""
    install()


def server_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` with this folder first on PYTHONPATH: a server started with it loads the
    controls (SGLang discovers the entry point through the dist-info here)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CONTROLS_DIR), env.get("PYTHONPATH")]))
    return env
