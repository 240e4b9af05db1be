"""Writes the seed corpus of fuzz_files (fuzz/fuzz_files.cpp): real TensorProto .pb files and real
checkpoints, each behind the one-byte mode prefix the target reads (fuzz/files_target.h):
0 = .pb tensor, 1 = checkpoint as is, 2 = checkpoint whose frame (sizes, CRC-32) the target repairs.

    /usr/bin/python3 fuzz/file_seeds.py OUT_DIR GRAFT_BINARY

Tensors come from onnx.numpy_helper / onnx.helper (raw and typed data, every dtype graft reads, a
scalar, an empty tensor, external data naming the target's data.bin) and from `graft train
--save-params`; checkpoints from `graft train --checkpoint` on a small Dropout MLP exported from
PyTorch (SGD with momentum and held gradients, AdamW, frozen parameters)."""
import pathlib
import subprocess
import sys
import tempfile

import numpy as np
import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

out, graft = pathlib.Path(sys.argv[1]), sys.argv[2]
out.mkdir(parents=True, exist_ok=True)


def put(name, mode, data):
    (out / name).write_bytes(bytes([mode]) + data)


# --- TensorProto .pb files -----------------------------------------------------------------------
rng = np.random.default_rng(0)
arrays = {
    "f32": rng.standard_normal((2, 3)).astype(np.float32),
    "f64_scalar": np.array(3.5, dtype=np.float64),
    "i64": np.arange(-3, 5, dtype=np.int64),
    "bool": np.array([True, False, True, True]),
    "f32_empty": np.zeros((0, 3), dtype=np.float32),
    "f32_4d": rng.standard_normal((1, 2, 2, 3)).astype(np.float32),
}
for k, a in arrays.items():
    put(f"pb_raw_{k}", 0, numpy_helper.from_array(a, name=k).SerializeToString())
typed = [
    helper.make_tensor("tf32", TensorProto.FLOAT, [2, 2], [1.0, -2.0, 3.5, 0.25]),
    helper.make_tensor("tf64", TensorProto.DOUBLE, [3], [1.0, 2.0, 3.0]),
    helper.make_tensor("ti64", TensorProto.INT64, [2, 1], [7, -9]),
    helper.make_tensor("tbool", TensorProto.BOOL, [3], [1, 0, 1]),
    helper.make_tensor("ti32", TensorProto.INT32, [2], [1, 2]),  # a dtype graft may refuse
]
for t in typed:
    put(f"pb_typed_{t.name}", 0, t.SerializeToString())
ext = TensorProto(name="ext", data_type=TensorProto.FLOAT, dims=[4, 4])
ext.data_location = TensorProto.EXTERNAL
for k, v in (("location", "data.bin"), ("offset", "64"), ("length", "64")):
    e = ext.external_data.add()
    e.key, e.value = k, v
put("pb_external", 0, ext.SerializeToString())


# --- checkpoints from the graft CLI --------------------------------------------------------------
class DropoutMLP(nn.Module):
    def __init__(self, d_in=4, d_h=4, n_cls=3):
        super().__init__()
        self.fc1, self.out, self.drop = nn.Linear(d_in, d_h), nn.Linear(d_h, n_cls), nn.Dropout(0.25)

    def forward(self, x, y):
        return F.cross_entropy(self.out(self.drop(F.relu(self.fc1(x)))), y)


runs = {
    "sgd_momentum_hold": ["--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", "0.001", "--mode", "hold"],
    "adamw": ["--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01"],
    "sgd_frozen": ["--optimizer", "sgd", "--freeze", "fc1.bias"],
    "adamw_frozen_hold": ["--optimizer", "adamw", "--freeze", "out.bias", "--mode", "hold"],
}
with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    torch.manual_seed(0)
    m = DropoutMLP().train()
    x, y = torch.randn(2, 4), torch.randint(0, 3, (2,))
    with torch.no_grad():
        torch.onnx.export(m, (x, y), str(tmp / "m.onnx"), input_names=["x", "y"], output_names=["loss"],
                          opset_version=17, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    for name, args in runs.items():
        d = tmp / name
        cmd = [graft, "train", str(tmp / "m.onnx"), "--loss", "loss", "--steps", "2", "--threads", "1",
               "--checkpoint", str(d / "ckpt"), "--save-params", str(d / "params"), *args]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        ckpts = sorted((d / "ckpt").glob("ckpt-*.graft"))
        assert ckpts, f"graft train wrote no checkpoint for {name}"
        for mode in (1, 2):
            put(f"ckpt_{name}_{mode}", mode, ckpts[-1].read_bytes())
        if name == "adamw":
            for i, p in enumerate(sorted((d / "params").glob("*.pb"))):
                put(f"pb_param_{i}", 0, p.read_bytes())
print(f"fuzz_files seeds: {len(list(out.iterdir()))} files in {out}")
