# -*- coding: utf-8 -*-
# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""systemctl over an injected runner (PRIVATE to gpuflow.eagle3).

Its own file so that a module that only starts or stops units (gpu_reset) does not compile the drain
logic on every run: AnsiballZ imports module_utils from a zip, without byte-code caches.
"""

from __future__ import annotations

import os


def malformed_unit_name(name):
    """True for a name systemctl could read as an option or a path (or that is empty or holds blanks)."""
    return not name or "/" in name or name.startswith("-") or any(c.isspace() for c in name)


def unit_name(name):
    """The full unit name: a bare name is a service."""
    return name if "." in name else name + ".service"


class Systemd(object):
    """Thin systemctl wrapper over an injected ``run(argv) -> (rc, out, err)``."""

    def __init__(self, run, booted=None):
        self.run = run
        self._booted = booted

    def booted(self):
        if self._booted is None:
            self._booted = os.path.isdir("/run/systemd/system")
        return self._booted

    def load_state(self, unit):
        rc, out, err = self.run(["systemctl", "show", "--property=LoadState,ActiveState,ControlGroup", "--", unit])
        props = {}
        for line in (out or "").splitlines():
            k, dummy, v = line.partition("=")
            props[k.strip()] = v.strip()
        return rc, props

    def _unit_action(self, verb, unit, timeout=None):
        """``systemctl <verb> -- unit``, bounded by coreutils' timeout when one is given."""
        argv = ["systemctl", verb, "--", unit]
        if timeout:
            for d in ("/usr/bin", "/bin"):
                if os.path.exists(os.path.join(d, "timeout")):
                    argv = [os.path.join(d, "timeout"), "--kill-after=5", "%g" % float(timeout)] + argv
                    break
        return self.run(argv)

    def stop(self, unit, timeout=None):
        return self._unit_action("stop", unit, timeout)

    def start(self, unit, timeout=None):
        return self._unit_action("start", unit, timeout)
