"""The fleet summary's host classification (host_reset.fleet_summary, the gpu_reset_summary filter): each branch."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from ansible_collections.gpuflow.eagle3.plugins.module_utils.host_reset import fleet_summary, fleet_table  # noqa: E402

GPUS = [{"index": 0, "uuid": "GPU-0", "verdict": "healthy", "action": "none", "reset_s": None},
        {"index": 1, "uuid": "GPU-1", "verdict": "healthy", "action": "none", "reset_s": None}]
PREFLIGHT = {"plan": {"groups": []}, "selected": [], "gpus": GPUS}
REPORT = {"outcome": "reset", "ok": True, "needs_power_cycle": False, "drain_s": 1.5, "reset_s": 2.25, "host_s": 4.0,
          "explanation": "", "gpus": [{"gpu": 0, "uuid": "GPU-0", "action": "drain+reset", "verdict": "healthy",
                                       "reasons": ["device health unhealthy"], "reset_s": 2.0}]}
BREAKER = {"down": ["marked"], "go": ["ran", "fell", "later"]}


def one(host, hv, breaker=None, stage="final"):
    s = fleet_summary([host], {host: hv}, BREAKER if breaker is None else breaker, stage)
    assert len(s["hosts"]) == 1 and s["outcomes"] == {s["hosts"][0]["outcome"]: 1}
    return s["hosts"][0], [r for r in s["rows"] if r["host"] == host]


def test_the_role_s_report_wins():
    rep, rows = one("r", {"gpu_reset_report": dict(REPORT, host="r"), "gpu_reset_result": {"msg": "x"},
                          "gpu_reset_assessment": PREFLIGHT})
    assert rep["outcome"] == "reset" and rep["host"] == "r"
    assert rows == [{"host": "r", "gpu": 0, "action": "drain+reset", "verdict": "healthy", "drain_s": 1.5,
                     "reset_s": 2.0, "host_s": 4.0}]


def test_the_batch_s_module_report_gets_the_host_name():
    rep, rows = one("ran", {"gpu_reset_result": {"report": REPORT}, "gpu_reset_assessment": PREFLIGHT})
    assert rep == dict(REPORT, host="ran") and [r["verdict"] for r in rows] == ["healthy"]


def test_unreachable_without_a_preflight_and_with_an_unreachable_one():
    rep, rows = one("gone", {})
    assert (rep["outcome"], rep["ok"], rep["explanation"]) == ("unreachable", False, "not reachable at pre-flight")
    assert rows == [{"host": "gone", "gpu": "-", "action": "none", "verdict": "unreachable", "drain_s": None,
                     "reset_s": None, "host_s": None}]
    rep, dummy = one("gone", {"gpu_reset_assessment": {"unreachable": True, "msg": "ssh: timeout"}})
    assert rep["outcome"] == "unreachable" and rep["explanation"] == "not reachable at pre-flight: ssh: timeout"


def test_an_unknown_host_is_unreachable():
    s = fleet_summary(["ghost"], {}, {}, "final")
    assert s["hosts"][0]["outcome"] == "unreachable"


def test_preflight_failed_carries_the_module_message():
    rep, rows = one("bad", {"gpu_reset_assessment": {"failed": True, "msg": "malformed unit name"}})
    assert (rep["outcome"], rep["explanation"]) == ("preflight_failed", "malformed unit name")
    assert [r["gpu"] for r in rows] == ["-"]


def test_marked_host_still_needing_a_reset_is_not_retried():
    rep, rows = one("marked", {"gpu_reset_assessment": PREFLIGHT})
    assert rep["outcome"] == "needs_power_cycle" and rep["needs_power_cycle"] is True and not rep["ok"]
    assert [r["verdict"] for r in rows] == ["needs_power_cycle"]


def test_breaker_stage_reports_not_run_with_the_preflight_s_gpus():
    rep, rows = one("ran", {"gpu_reset_assessment": PREFLIGHT}, stage="breaker")
    assert rep["outcome"] == "not_run" and rep["explanation"] == "circuit breaker tripped before any change"
    assert [(r["gpu"], r["action"], r["verdict"]) for r in rows] == [(0, "none", "not_run"), (1, "none", "not_run")]


def test_a_host_to_reset_that_registered_no_report_failed():
    rep, rows = one("fell", {"gpu_reset_assessment": PREFLIGHT, "gpu_reset_result": {"msg": "connection lost"}})
    assert rep["outcome"] == "failed"
    assert rep["explanation"] == "failed before reporting (unreachable during the run?): connection lost"
    assert [r["gpu"] for r in rows] == ["-"]


def test_a_host_to_reset_that_never_ran_is_not_run():
    rep, rows = one("later", {"gpu_reset_assessment": PREFLIGHT}, stage="batch")
    assert rep["outcome"] == "not_run" and rep["explanation"].startswith("not run: the run stopped before its batch")
    assert [r["verdict"] for r in rows] == ["not_run", "not_run"]


def test_a_host_the_preflight_found_healthy():
    rep, rows = one("clean", {"gpu_reset_assessment": PREFLIGHT})
    assert (rep["outcome"], rep["ok"]) == ("healthy", True)
    assert [(r["gpu"], r["action"], r["verdict"]) for r in rows] == [(0, "none", "healthy"), (1, "none", "healthy")]


def test_outcomes_are_counted_and_the_table_explains_hosts_that_are_not_ok():
    hv = {"a": {"gpu_reset_result": {"report": REPORT}}, "b": {"gpu_reset_assessment": PREFLIGHT},
          "c": {"gpu_reset_assessment": {"msg": "boom"}}}
    s = fleet_summary(["a", "b", "c"], hv, {"go": ["a"]}, "final")
    assert s["stage"] == "final" and s["breaker"] == {"go": ["a"]}
    assert s["outcomes"] == {"reset": 1, "healthy": 1, "preflight_failed": 1}
    lines = fleet_table(s)
    assert lines[0].split() == ["HOST", "GPU", "ACTION", "VERDICT", "DRAIN_S", "RESET_S", "HOST_S"]
    assert lines[1].split() == ["a", "0", "drain+reset", "healthy", "1.50", "2.00", "4.00"]
    assert lines[4].split() == ["c", "-", "none", "preflight_failed", "-", "-", "-"]
    assert lines[5:] == ["  c: boom"]
