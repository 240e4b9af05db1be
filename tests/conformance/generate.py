#!/usr/bin/python3
"""Writes ONNX's backend node test cases (model + test_data_set_0) into DIR/node.

Usage: /usr/bin/python3 tests/conformance/generate.py DIR

Uses onnx's own generator (onnx.backend.test.cmd_tools.generate_data) in-process, restricted to
node cases. numpy's global RNG is seeded so every run writes the same data, and DIR/node is
rebuilt from scratch (through a temporary folder renamed into place), so re-running is safe.
"""
import os
import shutil
import sys
import argparse
import warnings

import numpy as np

# numpy 1.24 removed these aliases; onnx 1.12's test-case generators still use them.
np.float = float
np.int = int
np.bool = bool
np.object = object
np.complex = complex
np.str = str


def main(argv):
    if len(argv) != 2:
        print("usage: generate.py DIR", file=sys.stderr)
        return 2
    out = os.path.abspath(argv[1])
    os.makedirs(out, exist_ok=True)

    import onnx
    import onnx.backend.test.case.model as model_test
    from onnx.backend.test import cmd_tools

    # Node cases only: the model cases point at downloadable real-world models.
    model_test.collect_testcases = lambda *a, **k: []

    np.random.seed(0)
    tmp = os.path.join(out, ".node.tmp")
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cmd_tools.generate_data(argparse.Namespace(output=tmp, op_type=None))
    final = os.path.join(out, "node")
    old = os.path.join(out, ".node.old")
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(os.path.join(tmp, "node"), final)
    shutil.rmtree(tmp)
    if os.path.exists(old):
        shutil.rmtree(old)
    n = len([d for d in os.listdir(final) if d.startswith("test_")])
    with open(os.path.join(out, "onnx_version.txt"), "w") as f:
        f.write(onnx.__version__ + "\n")
    print(f"generate.py: wrote {n} node cases to {final} (onnx {onnx.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
