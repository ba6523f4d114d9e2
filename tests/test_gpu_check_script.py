"""scripts/gpu_check.py runs end to end on the CPU with tiny configs and writes the JSON it promises."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

# only a guard against a hang: on a busy CI machine a run can take many times its usual tens of seconds
SUBPROCESS_TIMEOUT_S = 1800

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def measured(x) -> bool:
    """A timing or a ratio of timings the script reported: a finite number (no bound on its value)."""
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_gpu_check_small_quick_on_cpu(tmp_path):
    # the documented CPU invocation; run from tmp_path so the default --out (gpu_check.json) lands there
    env = dict(os.environ, OMP_NUM_THREADS="1")  # a shared 2-core machine: one thread keeps it quick
    env.pop("SPECDECODE_TEST_DEVICE", None)
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--skip-tests", "--small"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verification cost v(k)" in proc.stdout and "draft cost c" in proc.stdout

    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["errors"] == {}
    assert "tests" not in res  # --skip-tests
    env_ = res["environment"]
    assert env_["device"] == "cpu" and env_["small"] and env_["quick"]
    assert env_["dtype"] in ("float32", "bfloat16") and env_["torch"] and env_["device_name"]
    assert "commit" in env_

    assert positive(res["models"]["target"]["params"]) and positive(res["models"]["draft"]["params"])
    dec = res["decode"]
    assert dec["new_tokens"] == 16 and all(r["tokens"] == 16 for r in dec["runs"])
    assert all(measured(dec[key]) for key in ("tok_s", "decode_tok_s", "step_ms", "forward_ms", "engine_overhead"))

    ver = res["verify"]
    ks, batches = ver["ks"], [str(b) for b in res["plan"]["batches"]]
    assert ks == [1, 2, 4, 8] and ver["complete"] and ver["finite_logits"]
    assert list(ver["by_batch"]) == batches
    for row in ver["by_batch"].values():
        assert sorted(int(k) for k in row["v"]) == ks and sorted(int(k) for k in row["v_forward"]) == ks
        assert all(
            measured(x)
            for x in [
                *row["v"].values(),
                *row["v_forward"].values(),
                *row["step_ms"].values(),
                *row["forward_ms"].values(),
            ]
        )

    draft = res["draft"]
    assert measured(draft["c"]) and list(draft["by_batch"]) == batches
    assert all(
        measured(r["c"]) and measured(r["draft_ms"]) and measured(r["target_ms"]) for r in draft["by_batch"].values()
    )

    spec = res["spec_step"]
    assert spec["k"] == 4 and spec["steps_timed"] == res["plan"]["spec_steps"]
    assert measured(spec["step_ms"]) and measured(spec["forwards_ms"]) and spec["drafted"] == 4 * spec["steps_timed"]

    proj = res["projection"]
    assert list(proj) == batches
    for row in proj.values():
        assert all(measured(a["speedup"]) and int(a["best_k"]) in ks for a in row["by_alpha"].values())
