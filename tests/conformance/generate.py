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


def restamp_old_opsets(node_dir):
    """A case written at an opset older than graft's 13..17 whose every op has had the same
    definition ever since (onnx.defs: the schema in force at 17 was already in force at the case's
    opset) is restamped to opset 17: it tests exactly the op graft implements. Cases whose op
    changed since (Reshape's shape input, ReduceSum's axes, ...) keep their opset and stay
    refused."""
    import onnx
    restamped = 0
    for d in sorted(os.listdir(node_dir)):
        path = os.path.join(node_dir, d, "model.onnx")
        if not os.path.exists(path):
            continue
        m = onnx.load(path)
        default = [o for o in m.opset_import if o.domain in ("", "ai.onnx")]
        if len(default) != 1 or default[0].version >= 13:
            continue
        old = default[0].version
        try:
            same = all(n.domain in ("", "ai.onnx") and onnx.defs.get_schema(n.op_type, 17).since_version <= old
                       for n in m.graph.node)
        except Exception:  # an op onnx does not know at 17
            same = False
        if same:
            default[0].version = 17
            onnx.save(m, path)
            restamped += 1
    return restamped


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
    restamped = restamp_old_opsets(final)
    n = len([d for d in os.listdir(final) if d.startswith("test_")])
    with open(os.path.join(out, "onnx_version.txt"), "w") as f:
        f.write(onnx.__version__ + "\n")
    print(f"generate.py: wrote {n} node cases to {final} (onnx {onnx.__version__}; {restamped} restamped "
          "from older opsets to 17, their ops unchanged since)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
