# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# The interpreter the venv is made from: the system's own /usr/bin/python3 where it is one the project
# takes (3.11+, with venv), else python3 on the PATH. Debian builds its Python with profile-guided
# optimisation: the suite's Python-bound tests (the lossless sweeps) ran 12-18% faster on it than on
# a pyenv build without it (2026-12-07), which keeps CI's run within its 30 minutes. Nothing the
# suite reads comes from the interpreter's own files (tests/data, specrun/demo/heldout_code.json).
# Linux only: a Mac's /usr/bin/python3 without the command-line tools opens an installer instead.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell [ "$$(uname -s)" = Linux ] && /usr/bin/python3 -c \
	'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && echo /usr/bin/python3 || echo python3)
endif
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specrun-installed
JOBS := $(shell nproc 2>/dev/null || echo 2)
# Test workers: one per core, at most 4 (each loads its own models). Every test file runs on one
# worker (--dist loadfile), so a file's module fixtures (the real model) load once. A worker runs
# llama.cpp with one thread (tests/conftest.py), so two workers fill two cores without spinning
# against each other. TEST_JOBS=0 runs the suite in this process.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)

SYSTEM := $(VENV)/.specrun-system
# `CMAKE_ARGS=-DGGML_CUDA=on make install` always reaches tools/install_llama_cpp.sh, which rebuilds
# llama-cpp-python only where the installed build is not what it asks for (make test and demo
# with CMAKE_ARGS exported do not reinstall: offline, as the suite runs, they could not).
.DEFAULT_GOAL := install
ifneq ($(and $(strip $(CMAKE_ARGS)),$(filter install,$(or $(MAKECMDGOALS),install))),)
$(STAMP): cmake-args-given
endif
.PHONY: cmake-args-given
cmake-args-given:
# The Python install and the Debian packages (mostly downloads) are made side by side; not where
# `clean` is asked for too (its goals would run beside the install).
ifeq ($(filter clean,$(MAKECMDGOALS)),)
MAKEFLAGS += -j2
endif

.PHONY: demo test install clean

install: $(STAMP) $(SYSTEM)

# llama-cpp-python builds from source with llama.cpp's RPC backend (about 3½ minutes on 2 cores;
# only when the installed one is not that), with llama.cpp's ggml-rpc-server beside it. The rest
# installs with uv (a wheel from PyPI): its parallel downloads took 14 s here where pip took 92.
# uv reads UV_INDEX_URL, not pip's configuration: where it fails (a mirror only pip knows), pip.
$(STAMP): pyproject.toml tools/install_llama_cpp.sh tools/llama_cpp_no_common.cmake
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip 'uv>=0.9'
	tools/install_llama_cpp.sh $(VENV) $(JOBS)
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(VENV)/bin/uv pip install --quiet --python $(PY) -e '.[llama,mlx,dev]' \
		|| CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install --quiet -e '.[llama,mlx,dev]'
	touch $(STAMP)

# Debian's chromium and OpenBLAS for the tests, where root can install them (else a note).
$(SYSTEM): tools/install_system_packages.sh
	mkdir -p $(VENV)
	tools/install_system_packages.sh
	touch $(SYSTEM)

demo: $(STAMP)
	$(VENV)/bin/specrun demo

# On Linux with OpenBLAS preloaded: MLX's Linux wheel multiplies with the reference BLAS
# (tools/with_openblas.sh says why, and why that is safe).
# Bytecode is written, under the venv (the tree stays clean), even where the environment says not to
# (PYTHONDONTWRITEBYTECODE=1, as the development image sets): the tests start many Pythons (servers,
# the CLI, ranks; tests/server/test_serve_api.py 25), and each compiled every module it imported
# again, ~1 s apiece (that file ran in 28-32 s, not 52-59, with them compiled once; 2026-12-07).
test: $(STAMP) $(SYSTEM)
	PYTHONPYCACHEPREFIX=$(abspath $(VENV))/pycache PYTHONDONTWRITEBYTECODE= tools/with_openblas.sh $(PY) -m pytest -q --durations=15 -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

clean:
	rm -rf $(VENV) build *.egg-info
