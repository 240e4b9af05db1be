"""The model zoo moved into the package: graft.zoo (python/graft/zoo.py), so that an installed
graft (python3 -m graft.bench --zoo) has it. `import zoo` from here gives that very module (not a
copy of its names), so setting zoo.SEQ / zoo.LAYERS still reaches the builders."""
import sys

from graft import zoo as _zoo

sys.modules[__name__] = _zoo
