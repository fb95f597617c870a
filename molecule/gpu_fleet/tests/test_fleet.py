"""Real state the four fleet runs left in each container (converge.yml), checked with testinfra.

fleet5-unreachable is stopped, so it is not a testinfra host.
"""

import json

import pytest

testinfra_hosts = ["fleet1-sigterm", "fleet2-protected", "fleet3-unsupported", "fleet4-unhealthy",
                   "fleet6-drained", "fleet7-healthy"]

# host -> (workload active?, resets of GPU 0, GPU 0 health, drained mark, needs_power_cycle mark)
EXPECTED = {
    "fleet1-sigterm": (True, 1, "ok", False, False),
    "fleet2-protected": (True, 1, "ok", False, False),
    "fleet3-unsupported": (False, 0, "unhealthy", True, True),
    "fleet4-unhealthy": (False, 2, "unhealthy", True, True),      # reset in run B and again in run D
    "fleet6-drained": (False, 1, "ok", True, False),
    "fleet7-healthy": (True, 0, "ok", False, False),
}


def _json(host, path):
    f = host.file(path)
    return json.loads(f.content_string) if f.exists else None


@pytest.fixture(scope="module")
def name(host):
    return host.ansible.get_variables()["inventory_hostname"]


def test_systemd_still_healthy(host):
    assert host.run("systemctl is-system-running").stdout.strip() in ("running", "degraded")


def test_workload_restored_only_where_healthy(host, name):
    active = host.service("gpu-workload.service").is_running
    assert active is EXPECTED[name][0], host.run("systemctl status gpu-workload.service --no-pager").stdout


def test_gpu0_reset_count_and_health(host, name):
    g = _json(host, "/var/lib/gpusim/gpus/0.json")
    assert g["reset"]["count"] == EXPECTED[name][1]
    assert g["health"] == EXPECTED[name][2]


def test_persistence_mode_restored_everywhere(host):
    for i in (0, 1):
        assert _json(host, "/var/lib/gpusim/gpus/%d.json" % i)["persistence_mode"] is True


def test_marks_in_state_file(host, name):
    st = _json(host, "/var/lib/gpuflow/gpu_state.json") or {}
    assert bool(st.get("drain", {}).get("drained")) is EXPECTED[name][3], st
    assert bool(st.get("reset", {}).get("needs_power_cycle")) is EXPECTED[name][4], st


def test_healthy_host_kept_its_workload_process(host, name):
    if name != "fleet7-healthy":
        pytest.skip("only fleet7-healthy keeps the workload it started with")
    before = host.file("/root/workload.pid").content_string.strip()
    now = host.check_output("systemctl show -p MainPID --value gpu-workload.service")
    assert before == now and before != "0"
    # run D's new fault on GPU 1 was never acted upon: the run stopped before this host's batch
    assert _json(host, "/var/lib/gpusim/gpus/1.json")["reset"]["count"] == 0


def test_stray_sigterm_ignoring_job_was_killed(host, name):
    if name != "fleet1-sigterm":
        pytest.skip("fleet1-sigterm only")
    assert not host.service("stray-job.service").is_running
    # [m]: the pattern must not match pgrep's own shell command line
    assert host.run("pgrep -f 'gpu_si[m].py hold .*--ignore-sigterm'").rc == 1


def _restarted(host, unit):
    """The unit runs now under a main PID other than the one it had before the fleet runs."""
    before = host.file("/root/%s.pid" % unit).content_string.strip()
    now = host.check_output("systemctl show -p MainPID --value %s" % unit)
    return host.service(unit).is_running and before not in ("", "0") and now not in ("0", before)


def test_protected_daemon_stopped_for_the_reset_and_started_again(host, name):
    if name != "fleet2-protected":
        pytest.skip("fleet2-protected only")
    assert _restarted(host, "nvidia-dcgm.service")
    assert host.process.filter(comm="nv-hostengine")


def test_daemon_stopped_for_the_failed_reset_and_started_again(host, name):
    if name != "fleet4-unhealthy":
        pytest.skip("fleet4-unhealthy only")
    assert _restarted(host, "dcgm-exporter.service")
    assert host.process.filter(comm="dcgm-exporter")


def test_no_gpu_memory_left_on_drained_hosts(host, name):
    if EXPECTED[name][0]:
        pytest.skip("workload running")
    st = json.loads(host.check_output("python3 /opt/gpuflow/gpu_sim.py status --state-dir /var/lib/gpusim"))
    assert all(g["used_mib"] <= 300 for g in st), st   # at most a daemon's 300 MiB
