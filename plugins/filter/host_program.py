# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)

from __future__ import annotations

DOCUMENTATION = r'''
---
name: host_program
short_description: One Python program, with the libraries it imports, as a single text to feed C(python -) on stdin
version_added: 0.1.0
description:
  - The host programs (C(vllm_proc.py), C(hs_extract.py)) run from the controller's copy before anything is installed
    on the host (a preflight, the first directories, a stop) by C(python -) reading them on stdin. One file cannot
    carry its imports; this filter puts the libraries in front of it as modules registered under their names, so
    that the program's own C(import gpuflow_jobs) finds them, as it does beside an installed copy.
  - Tracebacks name the program's and the libraries' own file names and line numbers.
options:
  _input:
    description: The program's source (for example C(lookup('ansible.builtin.file', 'vllm_proc.py'))).
    type: str
    required: true
  name:
    description: The program's file name, for C(sys.argv[0]) and tracebacks.
    type: str
    required: true
  libraries:
    description: Module name to source, for each library the program imports.
    type: dict
    required: true
author:
  - gpuflow maintainers (@gpuflow)
'''

EXAMPLES = r'''
- name: Find who listens on the port, with the controller's copy of the helper
  ansible.builtin.command:
    argv: ["{{ vllm_server_python }}", "-", port, --port, "8000"]
    stdin: >-
      {{ lookup('ansible.builtin.file', 'vllm_proc.py')
         | gpuflow.eagle3.host_program('vllm_proc.py', {'gpuflow_jobs': lookup('ansible.builtin.file', jobs_library)}) }}
'''

RETURN = r'''
_value:
  description: Python source that registers each library as a module, then runs the program as C(__main__).
  type: str
'''

LOADER = '''import sys
import types


def _gpuflow_register(name, source):
    module = types.ModuleType(name)
    module.__file__ = name + ".py"
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)


'''


def host_program(source, name, libraries):
    parts = [LOADER]
    for module, text in sorted(libraries.items()):
        parts.append("_gpuflow_register(%r, %r)\n" % (str(module), str(text)))
    parts.append("sys.argv[0] = %r\n" % str(name))
    parts.append('exec(compile(%r, %r, "exec"), {"__name__": "__main__", "__file__": %r})\n'
                 % (str(source), str(name), str(name)))
    return "".join(parts)


class FilterModule(object):
    def filters(self):
        return {"host_program": host_program}
