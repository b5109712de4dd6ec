"""Launch again and again while another thread of the process prints without a pause; a crash ends the process.

print() reads sys.stdout without taking a reference (CPython issue 130163), and nbkit.launch swaps sys.stdout for
the length of a launch (to drop the launcher's banner): this probes that the swap never frees a stream another
thread is writing through. Run on CPU ranks (gloo):

    python benchmarks/print_during_launch.py 100 > /dev/null   # exit 0: every launch ended; 139: a segfault
"""

from __future__ import annotations

import sys
import threading

import nbkit


def _answer() -> int:
    return 7


def main(launches: int) -> None:
    stop = threading.Event()

    def printer() -> None:
        while not stop.is_set():
            print("t")

    thread = threading.Thread(target=printer)
    thread.start()
    try:
        for i in range(launches):
            assert nbkit.launch(_answer, gpus=2) == 7
            print(f"launch {i} ok", file=sys.stderr, flush=True)
    finally:
        stop.set()
        thread.join()


if __name__ == "__main__":
    main(int(sys.argv[1]))
