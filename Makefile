# Two commands set everything up on a fresh machine:
#   make demo   trains a small model on WikiText-2 and runs the analyses on the embedded default
#   make test   runs the test suite (starts its own redis-server and PostgreSQL cluster)
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .make/installed

.PHONY: install demo test test-fast test-triton-newest bench system-deps clean

# PyPI's Linux torch is the CUDA build (several GB of nvidia-* wheels). When the indexes pip already has
# offer no CPU build of the pinned version (a local 2.13.0+cpu wheel, as on our machines), torch comes from
# PyTorch's CPU index, whose 2.13.0+cpu pip then prefers. TORCH_INDEX= (empty) never adds it.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PICKED = $(PIP) install -q --dry-run --ignore-installed --no-deps --report - -c constraints-cpu.txt torch 2>/dev/null \
  | $(PYTHON) -c "import json, sys; sys.exit(not any('+cpu' in i['metadata']['version'] for i in json.load(sys.stdin)['install']))"

$(STAMP): pyproject.toml constraints-cpu.txt
	@echo "installing lmscope and its dependencies (torch CPU, transformers, ...): the first run only, a few minutes"
	@index=; if [ -n "$(TORCH_INDEX)" ] && ! $(TORCH_PICKED); then index="--extra-index-url $(TORCH_INDEX)"; fi; \
	  echo "$(PIP) install -q -c constraints-cpu.txt $$index torch triton"; \
	  $(PIP) install -q -c constraints-cpu.txt $$index torch triton
	$(PIP) install -q -c constraints-cpu.txt -e '.[worker,triton,test]'
	@mkdir -p .make && touch $(STAMP)

# The stamp alone would miss an install that points at another checkout (a moved or copied
# tree): then lmscope is installed again from this one.
install:
	@$(PYTHON) -I -c "import lmscope, os, sys; sys.exit(os.path.realpath(os.path.dirname(lmscope.__file__)) != os.path.realpath('lmscope'))" 2>/dev/null || rm -f $(STAMP)
	@$(MAKE) --no-print-directory $(STAMP)

# redis-server, PostgreSQL and Chromium for the tests that use the real things (Debian packages; as root).
system-deps:
	@command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
	@command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
	  (apt-get update -q && apt-get install -y -q postgresql)
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)

demo: install
	$(PYTHON) -m lmscope.demo

test: install system-deps
	$(PYTHON) -m pytest -q

# The kernel tests again on the newest Triton on PyPI (DESIGN.md §6: the GPU image has 3.6, support
# both), from a target directory that shadows the pinned one.
TRITON_NEWEST ?= 3.9.0
test-triton-newest: install
	$(PIP) install -q --no-deps --target .make/triton-$(TRITON_NEWEST) triton==$(TRITON_NEWEST)
	PYTHONPATH=$(CURDIR)/.make/triton-$(TRITON_NEWEST) $(PYTHON) -c "import triton; print('kernel tests on triton', triton.__version__)"
	PYTHONPATH=$(CURDIR)/.make/triton-$(TRITON_NEWEST) $(PYTHON) -m pytest -q -p no:cacheprovider tests/kernels

test-fast: install
	$(PYTHON) -m pytest -q -x -m "not slow"

bench: install
	$(PYTHON) benchmarks/attention.py
	$(PYTHON) benchmarks/approximations.py
	$(PYTHON) benchmarks/norms.py
	$(PYTHON) benchmarks/pruning.py
	$(PYTHON) benchmarks/operator.py
	$(PYTHON) benchmarks/entropy.py

clean:
	rm -rf .make .demo build *.egg-info
