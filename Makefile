# Two commands set everything up on a fresh machine:
#   make demo   trains a small model on WikiText-2 and runs the analyses on the embedded default
#   make test   runs the test suite (starts its own redis-server and PostgreSQL cluster)
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
STAMP := .make/installed

.PHONY: install demo test test-fast bench system-deps clean

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PIP) install -q -c constraints-cpu.txt torch triton
	$(PIP) install -q -c constraints-cpu.txt -e '.[worker,triton,test]'
	@mkdir -p .make && touch $(STAMP)

install: $(STAMP)

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

test-fast: install
	$(PYTHON) -m pytest -q -x -m "not slow"

bench: install
	$(PYTHON) benchmarks/attention.py
	$(PYTHON) benchmarks/approximations.py
	$(PYTHON) benchmarks/norms.py
	$(PYTHON) benchmarks/entropy.py

clean:
	rm -rf .make .demo build *.egg-info
