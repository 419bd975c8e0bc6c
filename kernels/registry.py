"""The process registry: the one module-level state of the bundle, shared by every copy of it in a process.

`sys.modules[REGISTRY]` is a module object holding one slot per API version (`api1`, ...). The first copy of the
bundle imported in a process (sparsify.kernels, or a model folder's copy that transformers loads as
transformers_modules.<folder>.*) makes it, and every later copy of the same API version finds its slot there:
- `classes`: name -> the first copy's class (ffn_runtime's FFNRuntime, FFNLayer): one copy of the runtime code per
  process, whichever folder a model came from;
- `runtimes`: key -> live FFNRuntime (weakly: the custom op's argument), `keys`: their counter;
- `process`: the runtime of twell_ffn calls made outside a model;
- `announced`: the FFN paths logged once per process;
- `sms`: CUDA device index -> its streaming multiprocessors (the decode K2 sizes its grid by them).
No other module of the bundle keeps mutable state at module level (tests/kernels/test_ffn_runtime.py checks every
shipped file), Triton's kernel objects aside: their compile and autotuning caches are Triton's.

A field added to a slot later is filled in when a copy looks the slot up (one an older copy made lacks it). Bump
API when a field's meaning, the op's schema (ffn_runtime.py) or the runtime <-> SparseMLP interface changes: the
new version gets a slot of its own and registers its own op, so copies of both versions run side by side.
"""

from __future__ import annotations

import itertools
import sys
import types
import weakref

REGISTRY = "sparsify_ffn_registry"  # the sys.modules entry every copy of the bundle finds the registry by
API = 2  # 2: issue 42's runtime <-> SparseMLP interface (ffn_layer, weights, torch_ffn, projections), op ffn_2


def registry_slot(api: int = API) -> types.SimpleNamespace:
    """API version `api`'s slot of the process registry: made by the first copy of the bundle that asks, and
    completed with any field it lacks."""
    registry = sys.modules.get(REGISTRY)
    if registry is None:
        registry = sys.modules.setdefault(REGISTRY, types.ModuleType(REGISTRY, "sparsify's process registry (registry.py)"))
    slot = getattr(registry, f"api{api}", None)
    if slot is None:
        slot = types.SimpleNamespace()
        setattr(registry, f"api{api}", slot)
    fields = {"classes": dict, "runtimes": weakref.WeakValueDictionary, "keys": itertools.count,
              "process": lambda: None, "announced": set, "sms": dict}
    for name, start in fields.items():
        if not hasattr(slot, name):
            setattr(slot, name, start())
    return slot


SLOT = registry_slot()  # this API version's slot (the registry holds it: the only state here is the registry's)
