"""Where the kernel tests (tests/test_kernels_*.py) run their Triton kernels.

On a GPU the kernels run compiled, in this process. On CPU they run in Triton's interpreter,
which must be on when Triton is first imported (Triton's own library functions, `tl.sum`,
`tl.sort`, ..., are defined then); a pytest process that runs the rest of the suite cannot
promise that. So on CPU, unless TRITON_INTERPRET=1 is already set, each kernel test module's
`test_in_triton_interpreter` runs the whole module again in a child pytest with it set, and the
module's kernel tests (marked `direct`) are skipped in this process: they run, and can fail,
in the child. The comparisons with SGLang's CUDA kernels (`needs_gpu`) need a CUDA GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
DIRECT = GPU or os.environ.get("TRITON_INTERPRET") == "1"
direct = pytest.mark.skipif(not DIRECT, reason="runs in the TRITON_INTERPRET=1 child process")
needs_gpu = pytest.mark.skipif(
    not GPU, reason="compares with SGLang's CUDA kernels: needs a CUDA GPU, none on this machine"
)


def interpreter_test(module_file: str):
    """The module's `test_in_triton_interpreter`: the module in a child pytest under
    TRITON_INTERPRET=1 (the same -m expression), failing with the child's output."""

    @pytest.mark.skipif(DIRECT, reason="the kernels run in this process")
    def test_in_triton_interpreter(pytestconfig):
        cmd = [sys.executable, "-m", "pytest", module_file, "-q", "-p", "no:cacheprovider"]
        if pytestconfig.getoption("markexpr"):
            cmd += ["-m", pytestconfig.getoption("markexpr")]
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        child = subprocess.run(
            cmd, env=env, capture_output=True, text=True, cwd=Path(module_file).parent,
            check=False,
        )  # fmt: skip
        # 5: every test deselected by the -m expression
        assert child.returncode in (0, 5), child.stdout[-6000:] + child.stderr[-3000:]

    return test_in_triton_interpreter
