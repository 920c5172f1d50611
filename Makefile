# GPUFlex developer entry points. Works on a fresh machine with Python 3.11+ and make:
# the first target that needs it creates .venv and installs torch and the project.
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY         := $(VENV)/bin/python
STAMP      := $(VENV)/.gpuflex-installed

.PHONY: test demo bench lint install clean

install: $(STAMP)

# pip shows its own progress on a terminal; elsewhere (CI) it is quiet and the ==> lines say
# what is happening, so the first run is never a silent minute and a CI log stays short.
PIP_OUTPUT = $$(test -t 1 || echo --quiet)

$(PY):
	@echo "==> creating $(VENV) (once)"
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	@echo "==> installing torch ($(TORCH_SPEC)) into $(VENV): about a minute, once"
	@$(PY) -m pip install $(PIP_OUTPUT) "$(TORCH_SPEC)"
	@echo "==> installing GPUFlex and its test tools into $(VENV): about half a minute, once"
	@$(PY) -m pip install $(PIP_OUTPUT) -e ".[test]"
	@touch $(STAMP)
	@echo "==> $(VENV) is ready"

# The suite on SQLite, then again with every hub the tests start through tests/helpers.py on
# PostgreSQL (a server the run starts itself; the modules that start no hub ran in the first pass).
# Each pass ends with its 15 slowest tests: the run must stay well inside CI's 25 minutes.
test: $(STAMP)
	$(PY) -m pytest -q --durations=15
	GPUFLEX_TEST_STORE=postgresql $(PY) -m pytest -q --durations=15

demo: $(STAMP)
	$(VENV)/bin/gpuflex-hub demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy --strict protocol/

bench: $(STAMP)
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) bench/codec.py
	$(PY) bench/trainer.py
	$(PY) bench/aggregate.py
	$(PY) bench/model_delta.py
	$(PY) bench/blob_pack.py
	-$(PY) bench/bandwidth.py  # needs root for ip netns: says so and exits 2 without
	$(PY) bench/hub_load.py --nodes 10,100,1000 --sustained 1000,2000,4000
	$(PY) bench/robustness.py
	$(PY) bench/heterogeneity.py
	$(PY) bench/class_distance.py
	$(PY) bench/referee_calibration.py
	$(PY) bench/scaling.py
	$(PY) bench/simulation.py
	$(PY) bench/vs_flower.py
	$(PY) bench/pipeline.py
	$(PY) bench/pipeline_recovery.py
	$(PY) bench/pipeline_hybrid.py
	$(PY) bench/pipeline_replicas.py
	-$(PY) bench/pipeline_shaped.py  # needs root for ip netns: says so and exits 2 without
	$(PY) bench/experts.py
	$(PY) bench/pipeline_wan.py
	$(PY) bench/stage_checks.py
	$(PY) bench/node_devices.py
	$(PY) bench/lora.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
