#!/usr/bin/env python3
"""Fails on an upward #include between graft's layers.

The layers, lowest first: core <- ir <- ops <- autodiff <- plan <- exec <- train <- dist <- cli / python.
A file of a layer (src/<layer>/..., or include/graft/<header> of that layer) may include graft's
headers of its own layer and of the layers below it, never above. Usage: check_layers.py REPO_ROOT
"""
import pathlib
import re
import sys

ORDER = ["core", "ir", "ops", "autodiff", "plan", "exec", "train", "dist", "cli", "python"]
HEADER_LAYER = {"core.h": "core", "parallel.h": "core", "ir.h": "ir", "ops.h": "ops", "autodiff.h": "autodiff", "plan.h": "plan",
                "compile.h": "plan",
                "exec.h": "exec", "train.h": "train", "checkpoint.h": "train", "models.h": "train",
                "distributed.h": "dist"}


def main(root):
    root = pathlib.Path(root)
    bad, checked = [], 0
    files = [(p, HEADER_LAYER.get(p.name)) for p in (root / "include/graft").glob("*.h")]
    for layer in ORDER:
        files += [(p, layer) for p in (root / "src" / layer).glob("*") if p.suffix in (".h", ".cpp")]
    for path, layer in files:
        if layer is None:
            bad.append(f"{path}: a public header with no layer (add it to HEADER_LAYER)")
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = re.match(r'\s*#\s*include\s+"(?:graft/)?([^"]+)"', line)
            if not m:
                continue
            name = m.group(1)
            target = HEADER_LAYER.get(pathlib.PurePath(name).name) if "graft/" in line else None
            if target is None:
                rel = (path.parent / name).resolve()
                parts = rel.relative_to(root).parts if rel.is_relative_to(root) else ()
                target = parts[1] if len(parts) > 2 and parts[0] == "src" else None
            checked += 1
            if target and ORDER.index(target) > ORDER.index(layer):
                bad.append(f"{path.relative_to(root)}:{n}: layer '{layer}' includes '{name}' of layer '{target}' above it")
    for b in bad:
        print(b)
    print(f"{checked} includes checked, {len(bad)} upward")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
