"""Weights without a second copy: a model built on the meta device, its weights read from a file.

Note [weights without a copy]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The usual way to train a big model from a checkpoint holds its weights twice: the model is built
(random weights, one copy), then load_state_dict copies the checkpoint's tensors into it (the
second copy, for a moment). Near the machine's limit that moment decides what fits. So:

    with graft.init_empty_weights():          # parameters on the meta device; buffers real
        model = LlamaForCausalLM(config)
    g = graft.GraftModule(model, ..., weights="model.safetensors")   # or a state_dict

GraftModule sets each meta parameter (and meta buffer) to a CPU tensor from `weights` before the
capture. From a .safetensors file each tensor is a copy-on-write memory map of its bytes in the
file (read_safetensors): nothing is read until used, the page cache holds what is read, and a page
becomes the process's own only when training writes it, so the optimizer's updates never reach the
file. From a mapping (a state_dict, e.g. torch.load(f, mmap=True)) the tensor itself is taken when
its dtype matches and it is contiguous. A parameter already on the CPU is copied into (one copy).

Checked before anything is set, as load_state_dict(strict=True) does: a tensor of `weights` that
the module does not have, a parameter or persistent buffer that `weights` lacks while on the meta
device, a shape that differs; and a non-persistent buffer left on the meta device (it is not in a
checkpoint: build the model under graft.init_empty_weights(), which keeps buffers on the CPU); and
two values for one tied tensor.
"""
import contextlib
import json
import mmap
import os
import struct
import warnings

import torch

from .errors import GraftArgumentError, GraftInvalidModelError, GraftIoError

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def mapped(fileno, at, dtype, count):
    """A 1-D tensor of `count` elements of `dtype` at byte `at` of an open file: a copy-on-write
    memory map (nothing read until used; writes stay in this process), keeping its mapping alive."""
    start = at // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page
    esize = torch.empty(0, dtype=dtype).element_size()
    m = mmap.mmap(fileno, at + count * esize - start, offset=start, access=mmap.ACCESS_COPY)
    with warnings.catch_warnings():  # ("not writable": it is, copy-on-write)
        warnings.simplefilter("ignore")
        return torch.frombuffer(m, dtype=dtype, count=count, offset=at - start)


def read_safetensors(path):
    """{name: tensor} of a .safetensors file, each a copy-on-write memory map of its bytes (no read
    until used; writes stay in this process). Raises GraftIoError (cannot open it) or
    GraftInvalidModelError (not a .safetensors file, or a tensor that does not fit its bytes),
    naming the file and what is wrong."""
    path = os.fspath(path)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise GraftIoError(f"weights '{path}': cannot open it: {e.strerror}", "i/o error") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) != 8:
            raise GraftInvalidModelError(f"weights '{path}': not a .safetensors file (shorter than 8 bytes)",
                                     "invalid model")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, 100 << 20):
            raise GraftInvalidModelError(f"weights '{path}': not a .safetensors file (a header of {n} bytes)",
                                     "invalid model")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise GraftInvalidModelError(f"weights '{path}': the .safetensors header is not JSON ({e})",
                                     "invalid model") from None
        if not isinstance(header, dict):
            raise GraftInvalidModelError(f"weights '{path}': the .safetensors header is not an object", "invalid model")
        base, out = 8 + n, {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = _ST_DTYPES[info["dtype"]]
                shape = [int(d) for d in info["shape"]]
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise GraftInvalidModelError(f"weights '{path}': tensor '{name}' has a bad entry {info!r}",
                                         "invalid model") from None
            count = 1
            for d in shape:
                count *= d
            esize = torch.empty(0, dtype=dtype).element_size()
            if min(shape, default=0) < 0 or end - begin != count * esize or begin < 0 or base + end > size:
                raise GraftInvalidModelError(
                    f"weights '{path}': tensor '{name}' ({info['dtype']} {shape}) does not fit its bytes "
                    f"[{begin}, {end}) in a file of {size} bytes", "invalid model")
            if count == 0:
                out[name] = torch.empty(shape, dtype=dtype)
                continue
            at = base + begin
            t = mapped(f.fileno(), at, dtype, count)
            if at % esize:  # misaligned for its dtype: a copy rather than a bad pointer
                t = t.clone()
            out[name] = t.view(shape)
    return out


@contextlib.contextmanager
def init_empty_weights():
    """Modules built inside get their parameters on the meta device (no memory, no initialization);
    buffers stay real, so that those a module computes at construction (rotary frequencies) and
    that no checkpoint holds are kept. GraftModule(model, weights=...) gives the parameters their
    values."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def materialize(module, weights, module_name):
    """Gives `module`'s tensors their values from `weights` (a .safetensors path or a mapping of
    names to tensors), as Note [weights without a copy] says. Checks everything first."""
    source = weights if isinstance(weights, str) else os.fspath(weights) if isinstance(weights, os.PathLike) else None
    if source is not None:
        weights = read_safetensors(source)
    elif not hasattr(weights, "keys"):
        raise GraftArgumentError(f"{module_name}: weights= takes a .safetensors path or a state_dict (a mapping of "
                                 f"names to tensors), not {type(weights).__name__}", "invalid argument")
    where = f"weights '{source}'" if source else "weights"
    # Every tensor of the module by name (tied weights: each name of the shared tensor), and which
    # are persistent (state_dict's keys).
    named = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = mod_name + "." if mod_name else ""
        for n, p in mod._parameters.items():
            if p is not None:
                named[prefix + n] = (mod, n, p, True)
        for n, b in mod._buffers.items():
            if b is not None:
                named[prefix + n] = (mod, n, b, n not in getattr(mod, "_non_persistent_buffers_set", ()))
    extra = sorted(set(weights.keys()) - set(named))
    if extra:
        raise GraftArgumentError(f"{module_name}: {where} holds tensors the module does not have: "
                                 + ", ".join(extra[:5]) + (" ..." if len(extra) > 5 else ""), "invalid argument")
    missing, bad = [], []
    for name, (_, _, t, persistent) in named.items():
        if name in weights:
            w = weights[name]
            if not isinstance(w, torch.Tensor):
                bad.append(f"'{name}' is a {type(w).__name__}, not a tensor")
            elif tuple(w.shape) != tuple(t.shape):
                bad.append(f"'{name}' is {tuple(w.shape)} in {where}, {tuple(t.shape)} in the module")
        elif t.device.type == "meta":
            missing.append(name + ("" if persistent else " (a non-persistent buffer: build the model under "
                                                         "graft.init_empty_weights(), which keeps buffers real)"))
    names_of = {}  # a tied tensor's names in `weights`: they must hold one value
    for name, (_, _, t, _) in named.items():
        if name in weights:
            names_of.setdefault(id(t), []).append(name)
    for names in names_of.values():
        first = weights[names[0]]
        for other in names[1:]:
            w = weights[other]
            if isinstance(w, torch.Tensor) and isinstance(first, torch.Tensor) and \
                    w.shape == first.shape and not torch.equal(w, first):
                bad.append(f"'{names[0]}' and '{other}' are one tied tensor in the module, two values in {where}")
    if bad:
        raise GraftArgumentError(f"{module_name}: {where} does not fit the module: " + "; ".join(bad[:5]),
                                 "invalid argument")
    if missing:
        raise GraftArgumentError(f"{module_name}: on the meta device and not in {where}: " + ", ".join(missing[:5])
                                 + (" ..." if len(missing) > 5 else ""), "invalid argument")
    done, replaced = set(), {}
    with torch.no_grad():
        for name, (mod, n, t, _) in named.items():
            if name not in weights or id(t) in done:
                continue
            done.add(id(t))  # a tied tensor takes its value once (its first name)
            w = weights[name]
            if t.device.type != "meta":
                t.copy_(w)
                continue
            if w.dtype != t.dtype or not w.is_contiguous() or w.device.type != "cpu":
                w = w.to(device="cpu", dtype=t.dtype).contiguous()
            new = torch.nn.Parameter(w, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else w
            if hasattr(torch.utils, "swap_tensors"):  # torch >= 2.3: the same object, now on the CPU
                torch.utils.swap_tensors(t, new)
            else:  # (a meta tensor cannot take CPU data in place on older torch: a new object)
                replaced[id(t)] = (t, new)
    if replaced:
        _replace(module, replaced)


def _replace(module, replaced):
    """Puts each new tensor where its meta one was: in every module, and in every optimizer of the
    process that holds it (one built before the module was wrapped), so none keeps a meta tensor
    whose .grad would never be set."""
    import gc
    for mod in module.modules():
        for table in (mod._parameters, mod._buffers):
            for n, t in table.items():
                if t is not None and id(t) in replaced:
                    table[n] = replaced[id(t)][1]
    for opt in (o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)):
        for group in opt.param_groups:
            group["params"] = [replaced[id(p)][1] if id(p) in replaced else p for p in group["params"]]
