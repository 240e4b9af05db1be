"""Shared helpers for graft's Python tests: locating the CLI, exporting models, tensor files."""
import json
import os
import pathlib
import subprocess

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

ROOT = pathlib.Path(__file__).resolve().parents[2]


def graft_bin():
    b = os.environ.get("GRAFT_BIN")
    if b:
        return b
    for cand in (ROOT / "build" / "graft", ROOT / "build-dev" / "graft"):
        if cand.exists():
            return str(cand)
    pytest.skip("graft binary not found: set GRAFT_BIN")


def run_graft(*args, check=True):
    p = subprocess.run([graft_bin(), *map(str, args)], capture_output=True, text=True, errors="replace",
                       timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"graft {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def save_pb(path, array, name):
    onnx.save_tensor(numpy_helper.from_array(np.ascontiguousarray(array), name), str(path))


def load_pbs(folder, prefix):
    """Reads prefix_N.pb files into {tensor name: array}."""
    out = {}
    for f in sorted(pathlib.Path(folder).glob(f"{prefix}_*.pb")):
        t = onnx.load_tensor(str(f))
        out[t.name] = numpy_helper.to_array(t)
    return out


def json_lines(stdout):
    return [json.loads(l) for l in stdout.splitlines() if l.startswith("{")]
