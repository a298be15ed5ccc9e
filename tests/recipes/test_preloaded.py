"""`run_module`, what the recipes start their `lightning-megatron` commands with: on a machine without CUDA a fork of
one server that imported the libraries once, with the command's argv, working directory, environment, output and
exit status; a fresh process where the environment differs from the server's."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

PROBE = '''
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "variable": os.environ.get("PROBE_VARIABLE"),
                  "parent": os.getppid(), "main": __name__, "spec": __spec__.name}), flush=True)
print("to stderr", file=sys.stderr, flush=True)
sys.exit(int(sys.argv[1]))
'''

# in a process of its own: the recipe server it starts ends with it
DRIVER = '''
import json, os, sys
from pathlib import Path
from lightning_megatron.recipes.preloaded import run_module
env = {**os.environ, "PROBE_VARIABLE": "a"}
statuses = [run_module(["probe_module", "3", "first"], env, Path("first.log")),
            run_module(["probe_module", "0", "second"], env, Path("second.log")),
            run_module(["probe_module", "0", "third"], {**env, "PROBE_VARIABLE": "b"}, Path("third.log"))]
print(json.dumps({"pid": os.getpid(), "statuses": statuses}))
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA every command starts a fresh process")
def test_commands_fork_from_one_server_as_python_m_would_run_them_and_start_fresh_where_the_environment_differs(
        tmp_path: Path) -> None:
    (tmp_path / "probe_module.py").write_text(textwrap.dedent(PROBE))
    env = {key: value for key, value in os.environ.items() if key != "PROBE_VARIABLE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    completed = subprocess.run([sys.executable, "-c", DRIVER], cwd=tmp_path, env=env, capture_output=True,
                               text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    driver = json.loads(completed.stdout.splitlines()[-1])
    assert driver["statuses"] == [3, 0, 0]
    seen = {}
    for name in ("first", "second", "third"):
        report, stderr_line = (tmp_path / f"{name}.log").read_text().splitlines()
        seen[name] = json.loads(report)
        assert stderr_line == "to stderr"  # standard error in the same file, after what was printed before it
        assert seen[name]["argv"][1] == name and seen[name]["cwd"] == str(tmp_path)
        assert seen[name]["main"] == "__main__" and seen[name]["spec"] == "probe_module"
    assert seen["first"]["variable"] == seen["second"]["variable"] == "a" and seen["third"]["variable"] == "b"
    # the first two: forks of the server's handlers; the third: the driver's own child
    assert driver["pid"] not in (seen["first"]["parent"], seen["second"]["parent"])
    assert seen["third"]["parent"] == driver["pid"]
