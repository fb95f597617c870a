# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r'''
---
name: gpu_reset_table
short_description: The fleet GPU reset summary as a text table
version_added: 0.1.0
description:
  - Renders the output of P(gpuflow.eagle3.gpu_reset_summary#filter) as text lines, one per GPU row (C(HOST), C(GPU),
    C(ACTION), C(VERDICT), C(DRAIN_S), C(RESET_S), C(HOST_S); seconds with two decimals, C(-) when unknown), then one
    line per host that is not ok, with its explanation.
options:
  _input:
    description: The summary.
    type: dict
    required: true
author:
  - gpuflow maintainers (@gpuflow)
'''

EXAMPLES = r'''
- name: Print the table
  ansible.builtin.debug:
    msg: "{{ summary | gpuflow.eagle3.gpu_reset_table }}"
'''

RETURN = r'''
_value:
  description: The table's lines, header first.
  type: list
  elements: str
'''

from ansible_collections.gpuflow.eagle3.plugins.module_utils.host_reset import fleet_table


class FilterModule(object):
    def filters(self):
        return {"gpu_reset_table": fleet_table}
