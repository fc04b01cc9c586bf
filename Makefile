# One command to set everything up and train; one to set up test tools and run every test.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
PLUGINS := plugins/models-gpt2

.PHONY: setup setup-test train test test-fast clean

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH (or run: make PYTHON=python3 ...)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Core and every plugin, editable, with the pinned versions of constraints.txt.
$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt $(foreach p,$(PLUGINS),$(p)/pyproject.toml)
	$(BIN)/pip install --quiet -c constraints.txt -e . $(foreach p,$(PLUGINS),-e $(p))
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test]"
	@touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

train: setup
	$(BIN)/levanter train config/gpt2_nano.yaml

test: setup-test
	$(BIN)/python -m pytest -n 2 --dist loadgroup -q

test-fast: setup-test
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) logs checkpoints cache
