"""Summarise a py-spy raw profile (`py-spy record -f raw --threads`): per thread, its share of the samples and
the functions on its stacks (inclusive %), so GIL holders (`--gil`) or busy threads can be compared.

    python -m bench.pyspy_summary replica64_gil.raw --top 40
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

FRAME_FILE = re.compile(r"\((\S+?):\d+\)")
FRAME_LINE = re.compile(r" \(.*?:\d+\)$")


def frame_name(frame: str) -> str:
    """'func (path/file.py:12)' -> 'func file.py' (lines merged, so a function counts once)."""
    found = FRAME_FILE.search(frame)
    return FRAME_LINE.sub("", frame) + (" " + found.group(1).split("/")[-1] if found else "")


def summarize(path: Path, top: int) -> str:
    threads: collections.Counter = collections.Counter()
    functions: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples, frames = int(count), stack.split(";")
        total += samples
        threads[frames[0]] += samples
        for name in {frame_name(f) for f in frames[1:]}:  # inclusive: once per stack
            functions[frames[0]][name] += samples
    lines = [f"{path.name}: {total} samples"]
    for thread, samples in threads.most_common():
        lines.append(f"\n== {thread}: {samples} samples ({100 * samples / max(1, total):.1f}%)")
        lines += [f"  {100 * n / samples:5.1f}%  {name[:150]}" for name, n in functions[thread].most_common(top)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("raw", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=40, help="functions per thread")
    args = parser.parse_args()
    for path in args.raw:
        print(summarize(path, args.top))


if __name__ == "__main__":
    main()
