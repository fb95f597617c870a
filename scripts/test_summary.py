"""The end of a make test run's output: the tests that failed, with the first line of why, then the slowest
tests, from pytest's junit files (a test's time includes the set-up of the fixtures it was first to use) and
the "seconds<TAB>name" lines scripts/molecule.sh appends. CI shows only the tail of a run's output, so what
failed is said here, at the end."""
import argparse
import os
import xml.etree.ElementTree as ET


def case_name(case):
    return "%s::%s" % (case.get("classname", "").rsplit(".", 1)[-1], case.get("name"))


def junit_failures(path):
    for case in ET.parse(path).iter("testcase"):
        for outcome in ("failure", "error"):
            found = case.find(outcome)
            if found is not None:
                why = (found.get("message") or found.text or "").strip().splitlines() or [""]
                yield "%s %s: %s" % (outcome.upper(), case_name(case), why[0][:300])


def junit_times(path):
    for case in ET.parse(path).iter("testcase"):
        yield float(case.get("time") or 0), case_name(case)


def tsv_times(path):
    with open(path) as f:
        for line in f:
            seconds, name = (line.rstrip("\n").split("\t", 1) + [""])[:2]
            if name:
                yield float(seconds), name


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("paths", nargs="*", help="junit .xml files and times .tsv files; missing ones are skipped")
    args = parser.parse_args()
    paths = [p for p in args.paths if os.path.isfile(p)]
    failures = [line for p in paths if p.endswith(".xml") for line in junit_failures(p)]
    if failures:
        print("=== the failed tests ===")
        print("\n".join(failures))
    times = [t for p in paths for t in (junit_times(p) if p.endswith(".xml") else tsv_times(p))]
    print("=== the %d slowest tests and scenarios (set-up included) ===" % args.top)
    for seconds, name in sorted(times, reverse=True)[:args.top]:
        print("%7.0fs  %s" % (seconds, name))
    if not times:
        print("(no test times recorded)")


if __name__ == "__main__":
    main()
