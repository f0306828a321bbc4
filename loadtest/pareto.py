#!/usr/bin/env python3
"""Pareto curves (DSpark paper Figures 7 and 8) from `loadtest/sla.py` summaries.

    python loadtest/pareto.py runs/no-spec runs/mtp1 runs/dspark --out plots \\
        --arm dspark --baseline mtp1

The same code as `sglang-dspark pareto ...`: everything lives in `sglang_dspark/pareto.py`
(the maths, the plots and the options: `--help`).
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from sglang_dspark.pareto import main
except ImportError:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sglang_dspark.pareto import main

if __name__ == "__main__":
    sys.exit(main())
