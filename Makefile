# Fresh machine: `make demo` trains a small model, `make test` runs the tests.
VENV   := .venv
PYTHON := $(VENV)/bin/python
PIP    := $(PYTHON) -m pip

.PHONY: install demo test test-fast test-transformers-floor check-recipes clean

# The stamp is rebuilt when the packaging changes; the venv itself only once.
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	# torch first and pinned, so pip takes the local CPU wheel and never
	# resolves `torch>=2.5` to a (much larger) CUDA build.
	$(PIP) install torch==2.13.0
	# Editable: configs/ lives at the repo root and is found next to the package.
	# Optional extras the tests cover: hf (transformers), report (matplotlib),
	# data (pyarrow, datasets: prepare-data's parquet and datasets sources),
	# tensorboard (logger=tensorboard), tracking (mlflow-skinny and wandb:
	# logger=mlflow|wandb), slurm (submitit: launcher=slurm, whose tests run it
	# end to end through submitit's local executor).
	$(PIP) install -e '.[test,hf,report,data,tensorboard,tracking,slurm]'
	touch $@

demo: install
	$(VENV)/bin/tpctl train mode=1d size=2

# Two workers (pytest-xdist): the suite also passes serially (`pytest -q`).
test: install
	$(PYTHON) -m pytest -q -n 2

test-fast: install
	$(PYTHON) -m pytest -q -n 2 -m "not slow"

# The family tests again on the oldest transformers pyproject.toml allows (the
# venv holds the newest the registry serves): installed beside the venv in a
# folder of its own that shadows the venv's copy on PYTHONPATH, with the
# versions of its own dependencies that it asks for.
TF_FLOOR = $(shell sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
TF_DIR   := .transformers-floor
test-transformers-floor: install
	test -f $(TF_DIR)/.installed-$(TF_FLOOR) || { rm -rf $(TF_DIR) && \
		$(PIP) install -q --target $(TF_DIR) 'transformers==$(TF_FLOOR).*' && touch $(TF_DIR)/.installed-$(TF_FLOOR); }
	PYTHONPATH=$(CURDIR)/$(TF_DIR) TPCTL_TRANSFORMERS=$(TF_FLOOR) $(PYTHON) -m pytest -q -n 2 \
		tests/test_families.py tests/test_families_anymodel.py

# Every recipe in recipes/, in its short form, against its loss band and
# equalities (CI runs this after the tests).
check-recipes: install
	$(VENV)/bin/tpctl check-recipes --fast --jobs 2

clean:
	rm -rf outputs multirun .pytest_cache $(TF_DIR)
