# make test  : create .venv, install torch (if none is importable), build, run the whole suite
# make bench : same setup, then the benchmarks (GPU if there is one, else CPU): kernels, step, train
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
SOURCES := setup.py CMakeLists.txt pyproject.toml $(wildcard csrc/*)

.PHONY: test bench install clean

# --system-site-packages: reuse a torch/triton already installed system-wide (GPU machines).
$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_SPEC)
	touch $@

$(VENV)/.build-deps: $(VENV)/.torch
	$(PY) -c "import pybind11, setuptools, wheel" 2>/dev/null && command -v cmake >/dev/null \
		&& command -v ninja >/dev/null || $(PIP) install setuptools wheel pybind11 cmake ninja
	touch $@

$(VENV)/.installed: $(VENV)/.build-deps $(SOURCES)
	$(PIP) install --no-build-isolation --no-deps -e .
	$(PY) -c "import accumkernels._C as C; print('built accumkernels._C:', C.build_info())"
	touch $@

# The [test] extra of pyproject.toml, without reinstalling (and rebuilding) the package.
$(VENV)/.test-deps: $(VENV)/.torch pyproject.toml
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))\
		['project']['optional-dependencies']['test'])" | xargs $(PIP) install
	touch $@

install: $(VENV)/.installed

test: $(VENV)/.installed $(VENV)/.test-deps
	$(PY) -m pytest

# The [bench] extra of pyproject.toml: matplotlib (the plot), transformers (the training table's
# models). Installed into the venv even where --system-site-packages would hide a missing one.
$(VENV)/.bench-deps: $(VENV)/.torch pyproject.toml
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))\
		['project']['optional-dependencies']['bench'])" | xargs $(PIP) install
	touch $@

# The kernels, the optimizer step against the inner optimizer's, the end-to-end training table.
bench: $(VENV)/.installed $(VENV)/.bench-deps
	$(PY) -m benchmarks.accumbench $(BENCH_ARGS)
	$(PY) -m benchmarks.accumbench step $(STEP_ARGS)
	$(PY) -m benchmarks.accumbench train $(TRAIN_ARGS)

clean:
	rm -rf build *.egg-info accumkernels/_C*.so .pytest_cache
