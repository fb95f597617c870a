"""Real host state of the default scenario, checked inside each container with testinfra."""

import pytest

HTTP_PORT = 8080
IDENT_PORT = 7070
USER = "gpuflow"
SERVED = "/srv/gpuflow"
# molecule.yml: gpu-node-3 runs the trixie image (Debian 13, Python 3.13), the others bookworm
DEBIAN_RELEASE = {"gpu-node-1": "12", "gpu-node-2": "12", "gpu-node-3": "13"}


@pytest.fixture(scope="module")
def peers(host):
    variables = host.ansible.get_variables()
    me = variables["inventory_hostname"]
    return [name for name in variables["groups"]["gpu_nodes"] if name != me]


def test_debian_release(host):
    name = host.ansible.get_variables()["inventory_hostname"]
    release = host.file("/etc/debian_version").content_string.strip()
    assert release.split(".")[0] == DEBIAN_RELEASE[name], release


def test_pid1_is_systemd(host):
    assert host.file("/proc/1/comm").content_string.strip() == "systemd"
    assert host.process.get(pid=1).comm == "systemd"


def test_system_is_running(host):
    state = host.run("systemctl is-system-running").stdout.strip()
    assert state in ("running", "degraded"), host.run("systemctl --failed --no-legend").stdout


def test_no_failed_units(host):
    failed = host.check_output("systemctl list-units --failed --plain --no-legend")
    assert failed == "", failed


def test_service_user(host):
    user = host.user(USER)
    assert user.exists
    assert user.uid < 1000
    assert user.group == USER
    assert user.shell == "/usr/sbin/nologin"


def test_served_files_and_owners(host):
    directory = host.file(SERVED)
    assert directory.is_directory
    assert (directory.user, directory.group, directory.mode) == (USER, USER, 0o750)
    page = host.file(f"{SERVED}/index.html")
    assert (page.user, page.group, page.mode) == (USER, USER, 0o640)
    assert page.content_string.strip() == host.ansible.get_variables()["inventory_hostname"]
    unit = host.file("/etc/systemd/system/gpuflow-http.service")
    assert (unit.user, unit.group, unit.mode) == ("root", "root", 0o644)


def test_http_unit_properties(host):
    service = host.service("gpuflow-http.service")
    assert service.is_running
    assert service.is_enabled
    props = service.systemd_properties
    assert props["ActiveState"] == "active"
    assert props["SubState"] == "running"
    assert props["User"] == USER
    assert props["Restart"] == "on-failure"
    assert props["NoNewPrivileges"] == "yes"
    assert props["PrivateTmp"] == "yes"
    assert props["ProtectSystem"] == "strict"
    main_pid = int(props["MainPID"])
    assert main_pid > 1
    process = host.process.get(pid=main_pid)
    assert process.user == USER
    assert "http.server" in process.args


def test_http_socket_listening(host):
    assert host.socket(f"tcp://0.0.0.0:{HTTP_PORT}").is_listening


def test_socket_activation(host):
    socket_unit = host.service("gpuflow-ident.socket")
    assert socket_unit.is_enabled
    assert socket_unit.is_running
    assert socket_unit.systemd_properties["Accept"] == "yes"
    assert host.socket(f"tcp://{IDENT_PORT}").is_listening
    # one connection starts one DynamicUser instance, which answers with the host name
    answer = host.check_output(
        "python3 -c 'import socket; s = socket.create_connection((\"127.0.0.1\", %d), 5);"
        " print(s.recv(256).decode().strip())'" % IDENT_PORT
    )
    assert answer == host.check_output("cat /etc/hostname")


def test_peers_resolve_by_name(host, peers):
    assert peers, "scenario should have more than one node"
    for peer in peers:
        assert host.run(f"getent hosts {peer}").rc == 0, f"{peer} does not resolve"


def test_peers_reachable_over_tcp(host, peers):
    for peer in peers:
        page = host.check_output(
            "python3 -c 'import urllib.request as u;"
            f" print(u.urlopen(\"http://{peer}:{HTTP_PORT}/\", timeout=5).read().decode().strip())'"
        )
        assert page == peer
        ident = host.check_output(
            "python3 -c 'import socket; s = socket.create_connection((\"%s\", %d), 5);"
            " print(s.recv(256).decode().strip())'" % (peer, IDENT_PORT)
        )
        assert ident == peer
