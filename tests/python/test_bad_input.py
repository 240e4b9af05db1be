"""Bad input gets a typed, one-line error naming the node / value at fault, and a non-zero exit;
never a signal or a hang."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_graft


def model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def vi(name, shape, t=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def good():
    w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    return model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                  helper.make_node("ReduceSum", ["h"], ["loss"], name="sum", keepdims=0)],
                 [vi("x", [4, 3])], [vi("loss", [])], [w])


def expect_error(args, *needles, code=2):
    p = run_graft(*args, check=False)
    assert p.returncode == code, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def write(tmp_path, m, name="m.onnx"):
    path = tmp_path / name
    path.write_bytes(m.SerializeToString() if not isinstance(m, bytes) else m)
    return path


def test_good_model_trains(tmp_path):
    p = run_graft("train", write(tmp_path, good()), "--loss", "loss", "--steps", "2")
    assert "step 2" in p.stdout


def test_missing_file(tmp_path):
    expect_error(["run", tmp_path / "nope.onnx"], "cannot open model file")


def test_truncated_file(tmp_path):
    data = good().SerializeToString()
    expect_error(["run", write(tmp_path, data[: len(data) // 2])], "invalid model")


def test_random_bytes(tmp_path):
    expect_error(["inspect", write(tmp_path, bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)))])


def test_unknown_op(tmp_path):
    m = model([helper.make_node("Frobnicate", ["x"], ["y"], name="frob")], [vi("x", [2])], [vi("y", [2])])
    expect_error(["run", write(tmp_path, m)], "frob", "Frobnicate", "unsupported")


def test_unsupported_opset(tmp_path):
    m = good()
    m.opset_import[0].version = 9
    expect_error(["run", write(tmp_path, m)], "opset 9", "13 to 17")


def test_unsupported_dtype(tmp_path):
    m = model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", [2], TensorProto.FLOAT16)], [vi("y", [2])])
    expect_error(["run", write(tmp_path, m)], "FLOAT16", "'x'")


def test_missing_initializer(tmp_path):
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [4, 3])], [vi("y", [4, 2])])
    expect_error(["run", write(tmp_path, m)], "mm", "'w'")


def test_cycle(tmp_path):
    m = model([helper.make_node("Relu", ["b"], ["a"], name="n1"), helper.make_node("Relu", ["a"], ["b"], name="n2")],
              [vi("x", [2])], [vi("a", [2])])
    expect_error(["run", write(tmp_path, m)], "cycle")


def test_shape_mismatch(tmp_path):
    w = numpy_helper.from_array(np.ones((5, 2), np.float32), "w")
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [4, 3])], [vi("y", [4, 2])], [w])
    expect_error(["run", write(tmp_path, m)], "mm", "inner dimensions")


def test_initializer_shorter_than_shape(tmp_path):
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[3, 2], raw_data=np.ones(4, np.float32).tobytes())
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [4, 3])], [vi("y", [4, 2])], [w])
    expect_error(["run", write(tmp_path, m)], "'w'", "needs 24")


def test_unknown_loss(tmp_path):
    expect_error(["train", write(tmp_path, good()), "--loss", "nope", "--steps", "1"], "'nope'", "loss")


def test_loss_not_scalar(tmp_path):
    expect_error(["train", write(tmp_path, good()), "--loss", "h", "--steps", "1"], "'h'", "scalar")


def test_unknown_freeze(tmp_path):
    expect_error(["train", write(tmp_path, good()), "--loss", "loss", "--freeze", "ghost"], "ghost")


def test_nan_loss_names_first_op(tmp_path):
    m = model([helper.make_node("Log", ["x"], ["l"], name="the_log"),
               helper.make_node("ReduceSum", ["l"], ["loss"], name="sum", keepdims=0)],
              [vi("x", [4])], [vi("loss", [])])
    x = numpy_helper.from_array(np.array([1, -1, 2, 3], np.float32), "x")
    (tmp_path / "x.pb").write_bytes(x.SerializeToString())
    expect_error(["run", write(tmp_path, m), "--inputs", tmp_path / "x.pb", "--check-finite"], "the_log", "non-finite")


def test_bad_cli_shape(tmp_path):
    expect_error(["run", write(tmp_path, good()), "--input", "x=4xq"], "'q'")
