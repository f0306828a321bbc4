"""The plugin fails loudly: a wrong sglang, a renamed or re-signed hook target, a failing install
or a hook SGLang did not apply stop the process with one message naming every failing hook.

SGLang's plugin loader logs and swallows a plugin's exceptions (`except Exception`), so the
refusal is a SystemExit. The unit tests drive `registry.install_checked` on a small fake
"upstream" module; the subprocess tests start the real `python -m sglang.launch_server` on an
SGLang altered by a `sitecustomize.py` (a target renamed, another given a new keyword, or a
different version reported) and show that it exits with status 1 and the message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sglang_dspark import SGLANG_VERSION

FAKE_UPSTREAM = """
def greet(name, *, loud=False):
    return name.upper() if loud else name


class Engine:
    def step(self, batch):
        return batch

    @classmethod
    def build(cls, n):
        return [cls() for _ in range(n)]
"""


@pytest.fixture
def hook_registry():
    """SGLang's HookRegistry, restored after the test (it is process-global)."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks = {k: list(v) for k, v in HookRegistry._hooks.items()}
    patched = set(HookRegistry._patched)
    yield HookRegistry
    HookRegistry._hooks.clear()
    HookRegistry._hooks.update(hooks)
    HookRegistry._patched.clear()
    HookRegistry._patched.update(patched)


@pytest.fixture
def upstream(tmp_path, monkeypatch, hook_registry):
    """A fresh fake upstream module and the signature table our fake hooks were written against."""
    from sglang_dspark.plugin import registry

    name = f"fake_upstream_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(FAKE_UPSTREAM)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module(name)
    monkeypatch.setattr(
        registry,
        "UPSTREAM_SIGNATURES",
        {
            f"{name}.greet": "(name, *, loud=False)",
            f"{name}.Engine.step": "(self, batch)",
            f"{name}.Engine.build": "(cls, n)",
        },
    )
    yield module
    sys.modules.pop(name, None)


def _around(target):
    from sglang_dspark.plugin.registry import register_around

    return lambda: register_around(target, lambda original, *a, **k: ("hooked", original(*a, **k)))


def _problems(checks) -> dict[str, list[str]]:
    return {c.name: c.problems for c in checks if c.problems}


def test_hooks_with_the_recorded_signatures_are_applied_and_verified(upstream):
    from sglang_dspark.plugin.registry import install_checked

    m = upstream.__name__
    checks = install_checked({
        "greet_hook": _around(f"{m}.greet"),
        "step_hook": _around(f"{m}.Engine.step"),
        "build_hook": _around(f"{m}.Engine.build"),
    })  # fmt: skip
    assert _problems(checks) == {}
    assert [c.targets for c in checks] == [
        [f"{m}.greet"],
        [f"{m}.Engine.step"],
        [f"{m}.Engine.build"],
    ]
    assert upstream.greet("a") == ("hooked", "a")
    assert upstream.Engine().step(3) == ("hooked", 3)
    assert upstream.Engine.build(2)[0] == "hooked"


def test_a_renamed_target_is_found_before_anything_is_applied(upstream):
    from sglang_dspark.plugin.registry import install_checked

    m = upstream.__name__
    upstream.greet_v2 = upstream.greet
    del upstream.greet  # upstream renamed it
    checks = install_checked(
        {"greet_hook": _around(f"{m}.greet"), "step_hook": _around(f"{m}.Engine.step")}
    )
    problems = _problems(checks)
    assert list(problems) == ["greet_hook"]
    assert f"{m}.greet does not resolve" in problems["greet_hook"][0]
    assert "renamed or removed upstream" in problems["greet_hook"][0]
    # nothing was applied: the step hook was fine, but the plugin refuses as a whole
    assert upstream.Engine().step(3) == 3


def test_a_new_keyword_upstream_is_a_signature_mismatch(upstream):
    from sglang_dspark.plugin.registry import install_checked

    m = upstream.__name__

    def step(self, batch, *, stream=None):  # upstream added a keyword
        return batch

    upstream.Engine.step = step
    problems = _problems(install_checked({"step_hook": _around(f"{m}.Engine.step")}))
    assert problems == {
        "step_hook": [
            f"{m}.Engine.step has the signature (self, batch, *, stream=None), "
            + "the hook was written against (self, batch)"
        ]
    }


def test_every_failing_install_is_reported_not_just_the_first(upstream):
    from sglang_dspark.plugin import refusal_message
    from sglang_dspark.plugin.registry import install_checked

    m = upstream.__name__

    def broken():
        raise ImportError("cannot import name 'Thing' from 'sglang.srt.x'")

    del upstream.greet
    checks = install_checked({
        "broken_hook": broken,
        "good_hook": _around(f"{m}.Engine.step"),
        "greet_hook": _around(f"{m}.greet"),
    })  # fmt: skip
    problems = _problems(checks)
    assert list(problems) == ["broken_hook", "greet_hook"]
    assert problems["broken_hook"] == [
        "install() raised ImportError: cannot import name 'Thing' from 'sglang.srt.x'"
    ]
    message = refusal_message("0.5.23", problems)
    assert message.startswith("sglang-dspark cannot hook sglang 0.5.23: 2 hook(s) failed")
    assert "  - broken_hook: install() raised ImportError" in message
    assert f"  - greet_hook: {m}.greet does not resolve" in message
    assert "SGLANG_DSPARK_DISABLE_HOOKS=broken_hook,greet_hook" in message


def test_a_hook_sglang_failed_to_apply_is_reported(upstream):
    from sglang_dspark.plugin.registry import install_checked, register_around

    m = upstream.__name__
    upstream.Engine.Inner = type("Inner", (), {})  # SGLang refuses AROUND on a class target
    sys.modules["sglang_dspark.plugin.registry"].UPSTREAM_SIGNATURES[f"{m}.Engine.Inner"] = None

    problems = _problems(
        install_checked({"class_hook": lambda: register_around(f"{m}.Engine.Inner", lambda o: o)})
    )
    assert problems == {
        "class_hook": [
            f"{m}.Engine.Inner is not patched: SGLang's HookRegistry did not apply the hook "
            + "(its log says why: 'Failed to apply hooks to ...')"
        ]
    }


def test_a_target_without_a_recorded_signature_is_refused_with_the_line_to_add(upstream):
    from sglang_dspark.plugin.registry import install_checked

    m = upstream.__name__
    upstream.fresh = lambda x, y=2: x
    problems = _problems(install_checked({"new_hook": _around(f"{m}.fresh")}))
    assert problems["new_hook"][0].startswith(
        f"{m}.fresh has no recorded upstream signature; add '{m}.fresh': '(x, y=2)' to "
        "UPSTREAM_SIGNATURES"
    )


def test_version_refusal_names_found_supported_and_override():
    from sglang_dspark.plugin import ALLOW_VERSION_ENV, version_problem

    assert version_problem(SGLANG_VERSION, {}) is None
    message = version_problem("0.6.0", {})
    assert f"supports sglang=={SGLANG_VERSION}, but sglang 0.6.0 is installed" in message
    assert f"pip install sglang=={SGLANG_VERSION}" in message
    assert f"set {ALLOW_VERSION_ENV}=0.6.0" in message
    assert version_problem("0.6.0", {ALLOW_VERSION_ENV: "0.6.0"}) is None
    other = version_problem("0.6.0", {ALLOW_VERSION_ENV: "0.5.99"})
    assert f"{ALLOW_VERSION_ENV}=0.5.99 names another version" in other


def test_register_raises_systemexit_on_a_wrong_version(monkeypatch):
    from sglang_dspark import plugin

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "installed_sglang_version", lambda: "0.6.0")
    monkeypatch.delenv(plugin.ALLOW_VERSION_ENV, raising=False)
    with pytest.raises(SystemExit) as info:  # what SGLang's `except Exception` lets through
        plugin.register()
    assert isinstance(info.value, plugin.PluginRefusal)
    assert "sglang 0.6.0 is installed" in str(info.value.code)


def test_scheduler_default_is_per_device_unless_a_verify_mode_is_set():
    from types import SimpleNamespace

    from sglang_dspark.plugin.scheduling import apply_mode_env, default_mode, launch_device

    assert default_mode("cpu") == "sync"
    assert default_mode("cuda") == default_mode("cuda:3") == default_mode("xpu") == "async"
    assert launch_device(SimpleNamespace(device="cpu")) == "cpu"
    env: dict[str, str] = {}
    assert apply_mode_env(env, default=default_mode("cpu")) == "sync"
    assert env == {"SGLANG_DSPARK_SCHEDULER": "sync", "SGLANG_RAGGED_VERIFY_MODE": "compact"}
    env = {}
    assert apply_mode_env(env, default=default_mode("cuda")) == "async"  # overlap kept
    assert env == {"SGLANG_DSPARK_SCHEDULER": "async", "SGLANG_RAGGED_VERIFY_MODE": "compact"}
    env = {"SGLANG_RAGGED_VERIFY_MODE": "static"}  # the user asked for upstream's mode
    assert apply_mode_env(env, default=default_mode("cpu")) is None
    assert env == {"SGLANG_RAGGED_VERIFY_MODE": "static"}
    env = {"SGLANG_DSPARK_SCHEDULER": "sync"}  # asked for on a GPU: kept
    assert apply_mode_env(env, default=default_mode("cuda")) == "sync"
    assert apply_mode_env({}) is None  # no default outside a DSPARK launch


def test_cpu_engine_is_set_for_a_cpu_device_and_a_contradiction_refused():
    from sglang_dspark.plugin.cpu_engine import CpuEngineConfigError, ensure_cpu_engine

    env: dict[str, str] = {}
    assert ensure_cpu_engine("cpu", env) and env == {"SGLANG_USE_CPU_ENGINE": "1"}
    assert not ensure_cpu_engine("cpu", env)  # already set
    assert not ensure_cpu_engine("cuda", {}) and not ensure_cpu_engine(None, {})
    with pytest.raises(CpuEngineConfigError, match="unset SGLANG_USE_CPU_ENGINE"):
        ensure_cpu_engine("cpu", {"SGLANG_USE_CPU_ENGINE": "0"})


def test_shape_caches_are_capped_for_a_cpu_device_unless_set():
    from sglang_dspark.plugin.cpu_memory import cap_shape_caches

    env: dict[str, str] = {}
    assert cap_shape_caches("cpu", env) == ["LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"]
    assert env == {"LRU_CACHE_CAPACITY": "16", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16"}
    explicit = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    assert cap_shape_caches("cpu", explicit) == ["LRU_CACHE_CAPACITY"]
    assert explicit == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024", "LRU_CACHE_CAPACITY": "16"}
    assert cap_shape_caches("cuda", {}) == [] and cap_shape_caches(None, {}) == []


# ------------------------------------------------------------------------ real processes
def _sitecustomize(tmp_path: Path, body: str) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    return env


FUTURE_SGLANG = """
    # A future sglang: one hook target renamed, another with a new keyword.
    import sglang.srt.speculative.spec_utils as spec_utils
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    spec_utils.row_argmax_v2 = spec_utils.row_argmax
    del spec_utils.row_argmax
    _forward_extend = TorchNativeAttnBackend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, *, sinks=None):
        return _forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache)

    TorchNativeAttnBackend.forward_extend = forward_extend
"""


def _launch(embedded_paths, env, timeout=600) -> tuple[subprocess.CompletedProcess, float]:
    """The README's serve command (what `sglang-dspark embedded --print-command` prints)."""
    from sglang_dspark.serving import embedded
    from sglang_dspark.serving.server import free_port

    cmd = embedded.launch_command(embedded_paths, port=free_port())
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return proc, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.sglang
def test_server_on_a_renamed_and_resigned_upstream_exits_with_every_failure(
    embedded_paths, tmp_path
):
    proc, _ = _launch(embedded_paths, _sitecustomize(tmp_path, FUTURE_SGLANG))
    assert proc.returncode == 1, proc.stderr[-3000:]
    err = proc.stderr
    assert "sglang-dspark cannot hook sglang" in err and "2 hook(s) failed" in err
    assert (
        "  - cpu_row_argmax: sglang.srt.speculative.spec_utils.row_argmax does not resolve" in err
    )
    assert (
        "  - torch_native_target_verify: sglang.srt.layers.attention.torch_native_backend."
        "TorchNativeAttnBackend.forward_extend has the signature (self, q, k, v, layer, "
        "forward_batch, save_kv_cache=True, *, sinks=None)" in err
    )
    assert "SGLANG_DSPARK_DISABLE_HOOKS=cpu_row_argmax,torch_native_target_verify" in err
    assert "Load weight begin" not in err and "Uvicorn running" not in err  # stopped before


@pytest.mark.slow
@pytest.mark.sglang
def test_server_on_another_sglang_version_exits_with_the_override(embedded_paths, tmp_path):
    env = _sitecustomize(
        tmp_path,
        """
        from sglang_dspark import plugin
        plugin.installed_sglang_version = lambda: "0.6.0"
        """,
    )
    proc, _ = _launch(embedded_paths, env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert (
        f"sglang-dspark supports sglang=={SGLANG_VERSION}, but sglang 0.6.0 is installed; "
        "SGLang was not started." in proc.stderr
    )
    assert "set SGLANG_DSPARK_ALLOW_SGLANG_VERSION=0.6.0" in proc.stderr


@pytest.mark.slow
def test_disabling_the_failing_hooks_lets_registration_through(tmp_path):
    """The message's way out works: the same future sglang, those hooks turned off."""
    env = _sitecustomize(tmp_path, FUTURE_SGLANG)
    env["SGLANG_DSPARK_DISABLE_HOOKS"] = "cpu_row_argmax,torch_native_target_verify"
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    code = "from sglang.srt.plugins import load_plugins; load_plugins(); print('REGISTERED')"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "REGISTERED" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_every_hook_target_on_this_sglang_is_recorded_and_patched():
    """On the supported sglang (CPU engine): no hook fails, every target it registers is in
    UPSTREAM_SIGNATURES with the live signature, and no recorded target is stale."""
    code = textwrap.dedent("""
        import json
        from sglang_dspark.plugin import _hooks
        from sglang_dspark.plugin.registry import DIRECT_TARGETS, install_checked

        checks = install_checked(_hooks())
        used = {t for c in checks for t in c.targets} | {t for ts in DIRECT_TARGETS.values() for t in ts}
        print("CHECKS " + json.dumps({
            "problems": {c.name: c.problems for c in checks if c.problems},
            "used": sorted(used),
            "hooks_with_targets": sorted(c.name for c in checks if c.targets),
        }))
    """)
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", SGLANG_PLUGINS="none")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    line = next((x for x in proc.stdout.splitlines() if x.startswith("CHECKS ")), None)
    assert line, proc.stderr[-3000:]
    result = json.loads(line[7:])
    assert result["problems"] == {}
    from sglang_dspark.plugin.registry import UPSTREAM_SIGNATURES

    assert set(UPSTREAM_SIGNATURES) == set(result["used"]), "stale or unused recorded targets"
    assert "torch_native_target_verify" in result["hooks_with_targets"]


SETUP_ENV = ("SGLANG_USE_CPU_ENGINE", "SGLANG_DSPARK_SCHEDULER", "SGLANG_RAGGED_VERIFY_MODE")


@pytest.mark.slow
@pytest.mark.sglang
def test_readme_serve_command_works_as_typed_without_environment(embedded_paths, tmp_path):
    """`--device cpu` alone: the plugin sets up SGLang's CPU engine and the sync scheduler.

    The README's command (`sglang-dspark embedded --print-command`) in this process's
    environment without SETUP_ENV, and nothing added (the session pool adds `launch_env()`)."""
    import requests

    from sglang_dspark.serving import embedded
    from sglang_dspark.serving.server import SGLangServer, free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in SETUP_ENV}
    cmd = embedded.launch_command(embedded_paths, port=port)
    server = SGLangServer(cmd, env, port, tmp_path / "server.log")
    try:
        server.start(timeout=900)  # SPS profiling at start-up on a busy 2-core machine
        r = requests.post(
            server.base_url + "/v1/completions",
            json={"model": "default", "prompt": "The capital of France is", "max_tokens": 3,
                  "temperature": 0},
            timeout=300,
        )  # fmt: skip
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] >= 1
        info = requests.get(server.base_url + "/server_info", timeout=60).json()
    finally:
        server.stop()
    assert info["speculative_algorithm"] == "DSPARK" and info["device"] == "cpu"
    assert info["disable_overlap_schedule"] is True  # the sync scheduler's setting
    log = server.log_path.read_text()
    assert "SGLANG_USE_CPU_ENGINE=1 set for this launch" in log
    assert "SGLANG_DSPARK_SCHEDULER=sync" in log


def test_register_refuses_when_a_hook_module_fails_to_import(monkeypatch):
    """SGLang's loader logs and swallows a plugin's exception and starts with no hooks; an
    import error inside the hook list must stop the process instead."""
    from sglang_dspark import plugin

    def broken_hooks():
        from sglang_dspark.plugin import no_such_hook_module  # noqa: F401

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_hooks", broken_hooks)
    with pytest.raises(SystemExit) as info:
        plugin.register()
    assert isinstance(info.value, plugin.PluginRefusal)
    message = str(info.value.code)
    assert "failed while registering its hooks: ImportError" in message
    assert "no_such_hook_module" in message and "SGLang was not started" in message


def test_loader_stops_on_a_hook_module_import_error(tmp_path):
    """Through SGLang's own `load_plugins()` (which catches `Exception`): status 1, not a
    silently unhooked process."""
    env = _sitecustomize(
        tmp_path,
        """
        from sglang_dspark import plugin
        def _broken():
            raise ImportError("cannot import name 'HOOKS' from 'sglang_dspark.plugin.cpu_x'")
        plugin._hooks = _broken
        """,
    )
    code = "from sglang.srt.plugins import load_plugins; load_plugins(); print('REGISTERED')"
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip
    assert proc.returncode == 1 and "REGISTERED" not in proc.stdout, proc.stderr[-3000:]
    assert "failed while registering its hooks: ImportError" in proc.stderr
