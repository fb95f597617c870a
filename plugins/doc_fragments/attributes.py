# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations


class ModuleDocFragment(object):

    # The attributes every gpuflow module documents (gpu_info, gpu_drain, gpu_reset). Ansible merges a module's own
    # attributes into these, key by key: a module adds diff_mode's support and the details where it differs.
    DOCUMENTATION = r'''
attributes:
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in check_mode), when in diff mode.
'''
