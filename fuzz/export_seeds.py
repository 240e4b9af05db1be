"""Writes real PyTorch-exported models (training and eval mode, opsets 13-17) into a fuzz corpus."""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "python"))
from models import make  # noqa: E402

out = pathlib.Path(sys.argv[1])
for name in ("mlp", "gpt"):
    model, args, names = make(name)
    for opset in (13, 15, 17):
        for training in (True, False):
            mode = torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL
            with torch.no_grad():
                torch.onnx.export(model, args, str(out / f"{name}_{opset}_{int(training)}.onnx"),
                                  input_names=list(names), opset_version=opset, training=mode,
                                  do_constant_folding=False)
