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


# ---- the hostile-model catalogue (hardening) -------------------------------------------------

def test_valid_file_with_flipped_bytes_never_crashes(tmp_path):
    """Flip bytes all over a valid model: each variant runs or fails with one line, never a signal."""
    data = bytearray(good().SerializeToString())
    rng = np.random.default_rng(1)
    for trial in range(40):
        d = bytearray(data)
        for pos in rng.integers(0, len(d), 3):
            d[pos] ^= int(rng.integers(1, 256))
        p = run_graft("run", write(tmp_path, bytes(d), f"f{trial}.onnx"), check=False)
        assert p.returncode in (0, 2), (trial, p.returncode, p.stderr)
        if p.returncode:
            assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("dims", [[-3, 2], [1 << 40, 1 << 40], [1 << 62, 4]])
def test_absurd_input_dims(tmp_path, dims):
    m = model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", dims)], [vi("y", dims)])
    expect_error(["run", write(tmp_path, m)], "x")


def test_absurd_initializer_dims_are_refused_before_allocating(tmp_path):
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1 << 20, 1 << 20], raw_data=b"\0" * 16)
    m = model([helper.make_node("Relu", ["w"], ["y"], name="r")], [], [vi("y", [2])], [w])
    expect_error(["run", write(tmp_path, m)], "'w'")


def test_zero_sized_dims_run(tmp_path):
    m = model([helper.make_node("Relu", ["x"], ["y"], name="r")], [vi("x", [0, 3])], [vi("y", [0, 3])])
    p = run_graft("run", write(tmp_path, m))
    assert "[0,3]" in p.stdout


def test_shape_tensor_with_overflowing_product(tmp_path):
    s = numpy_helper.from_array(np.array([1 << 40, 1 << 40, 16], np.int64), "s")
    m = model([helper.make_node("Reshape", ["x", "s"], ["y"], name="resh")], [vi("x", [4])], [vi("y", None)], [s])
    expect_error(["run", write(tmp_path, m)], "resh")


def test_expand_to_an_absurd_shape_is_refused_not_allocated(tmp_path):
    s = numpy_helper.from_array(np.array([1 << 30, 1 << 30], np.int64), "s")
    m = model([helper.make_node("Expand", ["x", "s"], ["y"], name="big")], [vi("x", [1])], [vi("y", None)], [s])
    line = expect_error(["run", write(tmp_path, m)], "big")
    assert "out of memory" in line or "too large" in line


def test_duplicate_value_names(tmp_path):
    m = model([helper.make_node("Relu", ["x"], ["y"], name="a"), helper.make_node("Neg", ["x"], ["y"], name="b")],
              [vi("x", [2])], [vi("y", [2])])
    expect_error(["run", write(tmp_path, m)], "'y'", "already has a definition")


def test_unknown_domain(tmp_path):
    n = helper.make_node("Relu", ["x"], ["y"], name="r", domain="com.example")
    m = model([n], [vi("x", [2])], [vi("y", [2])])
    expect_error(["run", write(tmp_path, m)], "com.example")


def test_attribute_of_the_wrong_type(tmp_path):
    n = helper.make_node("Transpose", ["x"], ["y"], name="tr")
    n.attribute.append(helper.make_attribute("perm", "not a list"))
    m = model([n], [vi("x", [2, 3])], [vi("y", [3, 2])])
    expect_error(["run", write(tmp_path, m)], "tr", "perm")


def test_huge_string_attribute(tmp_path):
    n = helper.make_node("Relu", ["x"], ["y"], name="r")
    n.attribute.append(helper.make_attribute("junk", "z" * (64 << 20)))  # 64 MiB of string
    m = model([n], [vi("x", [2])], [vi("y", [2])])
    p = run_graft("run", write(tmp_path, m), check=False)
    assert p.returncode in (0, 2), p.stderr  # ignored or refused, never a crash


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/passwd", "sub/../../outside.bin"])
def test_external_data_outside_the_model_folder_is_refused(tmp_path, location):
    (tmp_path / "outside.bin").write_bytes(b"\0" * 24)
    d = tmp_path / "model"
    d.mkdir()
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[3, 2])
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value=location)
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [4, 3])], [vi("y", [4, 2])], [w])
    expect_error(["run", write(d, m)], "'w'", "refused" if location.startswith("/") or location.startswith("..") else "outside")


def test_external_data_inside_the_model_folder_loads(tmp_path):
    (tmp_path / "w.bin").write_bytes(np.arange(6, dtype=np.float32).tobytes())
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[3, 2])
    w.data_location = TensorProto.EXTERNAL
    w.external_data.add(key="location", value="w.bin")
    m = model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", [4, 3])], [vi("y", [4, 2])], [w])
    run_graft("run", write(tmp_path, m))


def test_memory_budget_refuses_before_running(tmp_path):
    line = expect_error(["train", write(tmp_path, good()), "--loss", "loss", "--max-memory", "10"], "budget")
    assert "bytes" in line
