"""`auto` calibrated on a busy machine, then timed on a quieter one, in one `specdecode bench` run.

One CPU hog per core (a Python busy loop) runs from the start of the bench until `auto`'s calibration has
finished (the line that says the machine was busy, or the calibration's bar at 100 %), then stops, so the
configurations are timed without it while `auto` plans from the busy machine's costs:

    python docs/bench/auto-policy/busy_calibration.py --out runs/busy -- \
        --backend torch --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --extra-draft ngram \
        --draft-policy auto --draft-lengths 4 --baselines none --sampling greedy \
        --prompts humaneval:dev -n 10 --max-new-tokens 64

Everything after `--` goes to `specdecode bench` (with `--recalibrate`, so the calibration runs now).
`--code DIR` runs the specdecode in DIR instead (a `git worktree` of another commit: the control).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy processes (default: one per core)")
    parser.add_argument("--code", help="run the specdecode package in this checkout (PYTHONPATH) instead")
    parser.add_argument("bench", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    bench = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    start = time.monotonic()
    cmd = [sys.executable, "-m", "specdecode.cli", "bench", *bench, "--recalibrate", "--out", args.out]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.code:
        env["PYTHONPATH"] = os.path.abspath(args.code)
    print("+", " ".join(cmd), f"(with {len(hogs)} CPU hogs until auto's calibration ends)", file=sys.stderr, flush=True)
    out = os.path.abspath(args.out)
    cmd[cmd.index(args.out)] = out
    # from inside --code's checkout: `python -m` puts the working directory first on sys.path
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env, cwd=os.path.abspath(args.code) if args.code else None)
    seen = ""
    for raw in iter(lambda: proc.stderr.read1(4096), b""):
        text = raw.decode(errors="replace")
        sys.stderr.write(text)
        seen = (seen + text)[-4000:]
        if hogs and (
            "auto: the machine was busy" in seen
            or "calibrating step costs: 100%" in seen
            or ("calibrating step costs" in seen and "bench:" in seen)
        ):  # (older code: no bar)
            for h in hogs:
                h.kill()
            hogs = []
            print(
                f"\n[busy_calibration] hogs stopped after {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True
            )
    for h in hogs:
        h.kill()
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
