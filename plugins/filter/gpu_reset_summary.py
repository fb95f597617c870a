# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r'''
---
name: gpu_reset_summary
short_description: The fleet GPU reset summary, one report per targeted host
version_added: 0.1.0
description:
  - Sorts every targeted host of a fleet GPU reset into an outcome from what the plays left in its variables
    (C(gpu_reset_report), C(gpu_reset_result), C(gpu_reset_assessment)) and the circuit breaker's sort, in this order
    of precedence. V(healthy), V(reset), V(planned) and the module's verdicts come from the host's own report; the
    others are V(unreachable) (no or an unreachable pre-flight), V(preflight_failed) (the pre-flight call failed),
    V(needs_power_cycle) (marked by an earlier run and still needing a reset; not retried), V(not_run) (the breaker
    tripped, or the run stopped before the host's batch), V(failed) (the batch's call failed without a report) and
    V(healthy) (the pre-flight found nothing to reset).
  - The classification is M(gpuflow.eagle3.gpu_reset)'s own Python (its C(host_reset) module_utils), beside the
    per-host report the module returns.
  - Used by the C(summary) entry point of the P(gpuflow.eagle3.gpu_reset#role) role.
options:
  _input:
    description: The names of the targeted hosts, in the order of the summary.
    type: list
    elements: str
    required: true
  host_vars:
    description: The variables of every host (C(hostvars)).
    type: dict
    required: true
  breaker:
    description: The circuit breaker's sort of the hosts (keys C(down) and C(go), lists of host names); V({}) when it did not run.
    type: dict
    required: true
  stage:
    description: When the summary is written.
    type: str
    choices: [breaker, batch, final]
    required: true
author:
  - gpuflow maintainers (@gpuflow)
'''

EXAMPLES = r'''
- name: Build the fleet summary
  ansible.builtin.set_fact:
    summary: "{{ targeted_hosts | gpuflow.eagle3.gpu_reset_summary(hostvars, breaker, 'final') }}"
'''

RETURN = r'''
_value:
  description: The summary.
  type: dict
  contains:
    stage:
      description: The O(stage).
      type: str
    breaker:
      description: The O(breaker).
      type: dict
    hosts:
      description:
        - One report per host, as the module's RV(gpuflow.eagle3.gpu_reset#module:report) (plus C(host)), or C(host),
          C(outcome), C(ok), C(gpus) and C(explanation) for a host without one.
      type: list
      elements: dict
    rows:
      description:
        - One row per GPU (C(host), C(gpu), C(action), C(verdict), C(drain_s), C(reset_s), C(host_s)); a host with no
          known GPU has one row with C(gpu=-).
      type: list
      elements: dict
    outcomes:
      description: How many hosts ended with each outcome.
      type: dict
'''

from ansible_collections.gpuflow.eagle3.plugins.module_utils.host_reset import fleet_summary


def gpu_reset_summary(hosts, host_vars, breaker, stage):
    return fleet_summary(list(hosts), host_vars, dict(breaker or {}), stage)


class FilterModule(object):
    def filters(self):
        return {"gpu_reset_summary": gpu_reset_summary}
