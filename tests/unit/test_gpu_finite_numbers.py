"""Every number of seconds the GPU modules take is finite and in range, refused before anything is looked at.

Ansible's ``type: float`` turns "nan" and "inf" into floats, ``nan < 0`` is false, and a wait bounded by
either never ends (issue 23, finding 7). One helper, gpu_backend.bad_number, checks them all: the drain's,
the reset's, the reset's drain options and nvml_timeout.
"""

import pytest

from ansible_collections.gpuflow.eagle3.plugins.module_utils import drain as D
from ansible_collections.gpuflow.eagle3.plugins.module_utils import gpu_reset as R
from ansible_collections.gpuflow.eagle3.plugins.module_utils.gpu_backend import (
    BackendUnavailable,
    bad_number,
    select_backend,
)
from ansible_collections.gpuflow.eagle3.plugins.module_utils.host_reset import reset_host

NAN, INF = float("nan"), float("inf")
NOT_FINITE = [NAN, INF, -INF, "nan", "inf", "-Infinity"]


class Untouchable(object):
    """A backend, systemd or opener that fails the test when anything is asked of it."""

    def __getattr__(self, name):
        raise AssertionError("looked at %s before refusing the options" % name)

    def __call__(self, *args):
        raise AssertionError("opened the backend before refusing the options")


@pytest.mark.parametrize("value, minimum, above, maximum, words", [
    (NAN, 0, False, None, "x must be a finite number, not nan"),
    (INF, 0, False, None, "x must be a finite number, not inf"),
    (-INF, 0, False, None, "x must be a finite number, not -inf"),
    ("nan", 0.001, False, 5, "x must be a finite number, not nan"),
    (-1, 0, False, None, "x must be >= 0"),
    (0, 0, True, None, "x must be > 0"),
    (0, 0.001, False, 5, "x must be between 0.001 and 5 seconds"),
    (6, 0.001, False, 5, "x must be between 0.001 and 5 seconds"),
    ("soon", 0, False, None, "x must be a number, not 'soon'"),
    (None, 0, False, None, "x must be a number, not None"),
])
def test_bad_number_names_the_option_and_why(value, minimum, above, maximum, words):
    assert bad_number("x", value, minimum, above=above, maximum=maximum) == words


@pytest.mark.parametrize("value, minimum, above, maximum", [
    (0, 0, False, None), (15.0, 0, False, None), ("2.5", 0, True, None), (0.001, 0.001, False, 5), (5, 0.001, False, 5),
])
def test_bad_number_lets_a_usable_number_through(value, minimum, above, maximum):
    assert bad_number("x", value, minimum, above=above, maximum=maximum) is None


@pytest.mark.parametrize("value", NOT_FINITE + [-1])
@pytest.mark.parametrize("option", ["grace_period", "kill_timeout", "release_timeout", "unit_stop_timeout",
                                    "poll_interval"])
def test_gpu_drain_refuses_before_looking_at_the_host(option, value):
    with pytest.raises(D.DrainError, match="^%s must be " % option):
        D.run_drain(Untouchable(), {option: value}, systemd=Untouchable(), proc_root="/nonexistent",
                    signaller=Untouchable())


@pytest.mark.parametrize("value", NOT_FINITE + [-1, 0])
@pytest.mark.parametrize("option", ["reset_timeout", "command_timeout", "health_timeout", "unit_timeout",
                                    "poll_interval"])
def test_gpu_reset_refuses_before_opening_the_backend(option, value):
    with pytest.raises(R.ResetError, match="^%s must be " % option):
        R.run_reset(Untouchable(), {"gpus": ["all"], option: value}, systemd=Untouchable(),
                    proc_root="/nonexistent")


@pytest.mark.parametrize("value", NOT_FINITE + [-1])
@pytest.mark.parametrize("option", ["grace_period", "kill_timeout"])
def test_gpu_reset_refuses_its_drain_options_before_anything(tmp_path, option, value):
    state_file = tmp_path / "state.json"
    with pytest.raises(R.ResetError, match="^drain.%s must be " % option):
        reset_host(Untouchable(), {"gpus": ["all"]}, drain={"services": [], option: value},
                   state_file=str(state_file), mark_state=True, systemd=Untouchable())
    assert not state_file.exists()


@pytest.mark.parametrize("value", NOT_FINITE + [-1, 0])
@pytest.mark.parametrize("backend", ["nvml", "simulated", "auto"])
def test_every_backend_refuses_a_bad_nvml_timeout(tmp_path, backend, value):
    with pytest.raises(BackendUnavailable, match="^nvml_timeout must be "):
        select_backend(backend, str(tmp_path / "nowhere"), timeout=value, env={})
