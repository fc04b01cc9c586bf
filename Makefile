# One command to set everything up and train; one to set up test tools and run every test.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
PLUGINS := plugins/models-gpt2 plugins/models-llama plugins/models-gemma plugins/models-qwen3 \
           plugins/models-mixtral plugins/models-olmo plugins/models-gpt-oss \
           plugins/models-deepseek plugins/models-whisper plugins/data-hf \
           plugins/tracker-wandb plugins/tracker-tensorboard plugins/serve plugins/eval-harness \
           plugins/audio plugins/optim-contrib plugins/preference plugins/distill

.PHONY: setup setup-test train train-whisper speech-data test test-fast clean

$(BIN)/python:
	@$(PYTHON) -c "import sys; sys.exit(sys.version_info[:2] < (3, 11))" 2>/dev/null || { echo "need Python 3.11 or newer: make PYTHON=/path/to/python3.11"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Core (with Ray and Parquet support) and every plugin, editable, with the pinned
# versions of constraints.txt.
$(VENV)/.installed: $(BIN)/python pyproject.toml constraints.txt $(foreach p,$(PLUGINS),$(p)/pyproject.toml)
	$(BIN)/pip install --quiet -c constraints.txt -e ".[ray,parquet]" $(foreach p,$(PLUGINS),-e $(p))
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e ".[test]" -e "plugins/serve[test]" -e "plugins/eval-harness[test]"
	@touch $@

setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

train: setup
	$(BIN)/levanter train config/gpt2_nano.yaml

# Speech for config/whisper_nano.yaml, synthesized here by eSpeak NG (levanter-audio): 2,000
# training sentences and 64 held-out ones, in four voices, as FLAC files and JSON-lines manifests.
VOICES := --voice en-us+Storm --voice en-us+shelby --voice en-us+Denis --voice en-us+michel
speech-data: data/speech/train/manifest.jsonl data/speech/validation/manifest.jsonl
data/speech/train/manifest.jsonl: | $(VENV)/.installed
	$(BIN)/python -m levanter_audio.synth data/speech/train --random 2000 --seed 0 --fmt flac $(VOICES)
data/speech/validation/manifest.jsonl: | $(VENV)/.installed
	$(BIN)/python -m levanter_audio.synth data/speech/validation --random 64 --seed 1 --fmt flac $(VOICES)

train-whisper: setup speech-data
	$(BIN)/levanter train config/whisper_nano.yaml

# The speed figures of the reference GPT-2 and a Llama of the same size (bench/README.md).
.PHONY: bench
bench: setup
	$(BIN)/python bench/suite.py --out bench/last-suite.json

# The documentation site (mkdocs.yml): the guides of docs/ and the API reference generated from
# the plugin API's docstrings. `make docs` builds it into site/ (open site/index.html);
# `make docs-check` builds it strictly into a temporary folder, where a broken link, a missing
# anchor or an unresolved reference fails (tests/test_docs_site.py does the same in `make test`).
.PHONY: docs docs-check
$(VENV)/.installed-docs: $(VENV)/.installed
	$(BIN)/pip install --quiet -c constraints.txt -e ".[docs]"
	@touch $@

docs: $(VENV)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

docs-check: $(VENV)/.installed-docs
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir "$$tmp"

# Lint and format: every Python file of the repository (pyproject.toml's [tool.ruff]); the
# core's layers and what plugins may import (pyproject.toml's [tool.importlinter]); the core's
# types, strict on the public plugin API (pyproject.toml's [tool.mypy]).
.PHONY: lint
lint: setup-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# A worker that dies fails the run at once (xdist's replacement worker can wait forever).
test: setup-test lint
	$(BIN)/python -m pytest -n 2 --dist loadgroup --max-worker-restart=0 -q --durations=25

test-fast: setup-test
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) logs checkpoints cache data/speech
