# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specrun-installed
JOBS := $(shell nproc 2>/dev/null || echo 2)

.PHONY: demo test install clean

install: $(STAMP)

# llama-cpp-python builds from source with llama.cpp's RPC backend (about 6 minutes on 2 cores;
# only when the installed one is not that), with llama.cpp's ggml-rpc-server beside it.
$(STAMP): pyproject.toml tools/install_llama_cpp.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	tools/install_llama_cpp.sh $(VENV) $(JOBS)
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(PY) -m pip install --quiet -e '.[llama,mlx,dev]'
	command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && apt-get install -y -qq chromium; } || true
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specrun demo

test: $(STAMP)
	$(PY) -m pytest -q --durations=15

clean:
	rm -rf $(VENV) build *.egg-info
