# Copyright: gpuflow maintainers
# GNU General Public License v3.0+ (see COPYING or https://www.gnu.org/licenses/gpl-3.0.txt)
"""One CPU's speed: a pure-Python loop of STEPS steps, no I/O; prints the CPU seconds it took.
make test's summary prints it for 20 million steps, bench/two_cores.py runs it alone and two at once.

  python tools/cpu_loop.py STEPS
"""
import sys
import time


def main():
    start = time.process_time()
    x = 0
    for i in range(int(sys.argv[1])):
        x += i * i % 7
    print("%.2f" % (time.process_time() - start))


if __name__ == "__main__":
    main()
