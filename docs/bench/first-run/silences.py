"""Run a command and time what it prints: every chunk of output (stdout and stderr, progress-bar
redraws included) with the seconds since the start, then the longest silence and where it was.

    python docs/bench/first-run/silences.py --log run.log -- specdecode generate --target ... --prompt ...

The transcript (``--log``) has one line per chunk: ``<seconds> <stream> <text>``.
"""

from __future__ import annotations

import argparse
import os
import selectors
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", required=True, help="where the timed transcript goes")
    parser.add_argument("--limit", type=float, default=10.0, help="report silences longer than this (seconds)")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    last, gaps, open_streams = 0.0, [], 2
    with open(args.log, "w") as log:
        while open_streams:
            for key, _ in sel.select():
                chunk = os.read(key.fileobj.fileno(), 65536)
                now = time.monotonic() - start
                if not chunk:
                    sel.unregister(key.fileobj)
                    open_streams -= 1
                    continue
                text = chunk.decode(errors="replace")
                (sys.stdout if key.data == "out" else sys.stderr).write(text)
                gaps.append((now - last, last, text.strip()[:80]))
                last = now
                log.write(f"{now:9.2f} {key.data} {text!r}\n")
        code = proc.wait()
        end = time.monotonic() - start
        gaps.append((end - last, last, "<exit>"))
        long = [g for g in gaps if g[0] > args.limit]
        summary = (
            f"exit {code} after {end:.1f} s; longest silence {max(gaps)[0]:.1f} s; "
            f"{len(long)} silences over {args.limit:g} s: "
            + "; ".join(f"{g:.1f} s after {at:.1f} s (then {what!r})" for g, at, what in long)
        )
        log.write(summary + "\n")
    print(summary, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
