# shadefs: the two set-up commands of the README are `make demo` and `make test`.
# Both install everything they need on a fresh Debian/Ubuntu machine (system packages
# when run as root, then a virtual environment in .venv).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
APT_PACKAGES := fuse3 libfuse3-dev pkg-config gcc patch systemd attr diffutils findutils util-linux

.PHONY: setup system-deps demo test lint bench install clean pyfuse3

setup: $(VENV)/.installed $(VENV)/.pyfuse3-no-open

system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
		if [ -n "$$missing" ]; then \
			echo "installing system packages:$$missing"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		fi; \
	else \
		command -v fusermount3 >/dev/null || echo "warning: fusermount3 missing; install: $(APT_PACKAGES)"; \
	fi

$(VENV)/.installed: pyproject.toml constraints.txt | system-deps
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[torch,test]'
	touch $@

# pyfuse3 built from its pinned sdist with the project's patch (patches/pyfuse3-no-open.patch), for
# --kernel-hits. `make pyfuse3` builds it again (e.g. after a pip install replaced it).
$(VENV)/.pyfuse3-no-open: patches/pyfuse3-no-open.patch tools/install-pyfuse3.sh | $(VENV)/.installed
	sh tools/install-pyfuse3.sh $(PY)
	touch $@

pyfuse3: | $(VENV)/.installed
	sh tools/install-pyfuse3.sh $(PY)
	touch $(VENV)/.pyfuse3-no-open

demo: setup
	$(VENV)/bin/shadefs demo

# Every mount test runs a second time with every mount in kernel-hits mode (FUSE no-open),
# unless the test chose a mode itself (tests/conftest.py, `start_mount`).
test: setup
	$(VENV)/bin/ruff check shadefs tests tools examples
	$(VENV)/bin/ruff format --check shadefs tests tools examples
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider
	SHADEFS_TEST_KERNEL_HITS=on $(PY) -m pytest -q -p no:cacheprovider -m mount

# The benchmarks, listed in tools/README.md. `make bench` runs the quick ones; `make bench
# LONG=1` adds those that take many minutes: bench_ssd_hits and bench_restore (both need
# root, and bench_restore builds a million SSD entries), bench_e2e, bench_jobs_e2e and
# bench_nodes (torch training), bench_namespace (builds trees of 200k and 1.28 M files) and
# bench_shards (writes 1.9 GB of shards to the temp directory).
BENCH_QUICK := bench_epochs bench_hits bench_pads bench_handlers bench_jobs
BENCH_LONG  := bench_ssd_hits bench_e2e bench_restore bench_jobs_e2e bench_namespace bench_shards bench_nodes

bench: setup
	@for b in $(BENCH_QUICK) $(if $(LONG),$(BENCH_LONG)); do \
		echo "== python tools/bench/$$b.py"; \
		$(PY) tools/bench/$$b.py || exit 1; \
	done

install: setup
	PYTHON=$(abspath $(PY)) sh mount/install.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
