"""Print the slowest tests of a make test run: pytest's junit files (a test's time includes the set-up of
the fixtures it was first to use) and the "seconds<TAB>name" lines scripts/molecule.sh appends."""
import argparse
import os
import xml.etree.ElementTree as ET


def junit_times(path):
    for case in ET.parse(path).iter("testcase"):
        name = "%s::%s" % (case.get("classname", "").rsplit(".", 1)[-1], case.get("name"))
        yield float(case.get("time") or 0), name


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
    times = []
    for path in args.paths:
        if os.path.isfile(path):
            times.extend(junit_times(path) if path.endswith(".xml") else tsv_times(path))
    for seconds, name in sorted(times, reverse=True)[:args.top]:
        print("%7.0fs  %s" % (seconds, name))
    if not times:
        print("(no test times recorded)")


if __name__ == "__main__":
    main()
