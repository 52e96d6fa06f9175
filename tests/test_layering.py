"""The package's shape: one-way imports, light `mooncake.cache`, typed public API."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import mooncake

ROOT = Path(mooncake.__file__).resolve().parent

# Rank of each layer: a module may import only from layers of lower or equal rank
# (STYLE.md: values -> cache -> transfer | sched -> engine -> examples).
LAYERS = {
    "mooncake._checks": 0,
    "mooncake._extras": 0,
    "mooncake._files": 0,
    "mooncake._json": 0,
    "mooncake.errors": 0,
    "mooncake.types": 0,
    "mooncake.workload": 0,
    "mooncake.cache": 1,
    "mooncake.transfer": 2,
    "mooncake.sched": 2,
    "mooncake.engine": 3,
    "mooncake.sim": 3,
    "mooncake.cli": 4,
}
# Siblings that never import each other: transfer and sched; the torch engines and the simulator.
FORBIDDEN_PAIRS = {
    ("mooncake.transfer", "mooncake.sched"),
    ("mooncake.sched", "mooncake.transfer"),
    ("mooncake.engine", "mooncake.sim"),
    ("mooncake.sim", "mooncake.engine"),
}


def layer_of(module: str) -> str:
    best = ""
    for name in LAYERS:
        if (module == name or module.startswith(name + ".")) and len(name) > len(best):
            best = name
    assert best, f"{module} belongs to no layer: add it to LAYERS"
    return best


def module_names() -> list[str]:
    return sorted(
        info.name
        for info in pkgutil.walk_packages([str(ROOT)], prefix="mooncake.")
        if not info.name.endswith("__main__")
    )


def imports_of(module: str) -> set[str]:
    path = ROOT.joinpath(*module.split(".")[1:])
    source = (path / "__init__.py") if path.is_dir() else path.with_suffix(".py")
    tree = ast.parse(source.read_text(), filename=str(source))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {name for name in found if name == "mooncake" or name.startswith("mooncake.")}


@pytest.mark.parametrize("module", module_names())
def test_imports_go_one_way(module: str) -> None:
    """No module imports from a layer above its own, and transfer and sched never import each other."""
    own = layer_of(module)
    for imported in imports_of(module):
        if imported == "mooncake":
            continue
        other = layer_of(imported)
        assert LAYERS[other] <= LAYERS[own], f"{module} ({own}) imports {imported} ({other}), a higher layer"
        assert (own, other) not in FORBIDDEN_PAIRS, f"{module} imports {imported}: {own} and {other} are siblings"


def test_cache_import_is_light() -> None:
    """`import mooncake.cache` (and the workload layer) loads neither torch nor numba."""
    script = "import sys, mooncake.cache, mooncake.workload; print(sorted({'torch', 'numba'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# The packages of every optional extra (engine, accel, cluster, ray, plot, kv-events): absent from a plain install.
EXTRA_PACKAGES = ("aiohttp", "llvmlite", "matplotlib", "msgpack", "numba", "ray", "torch", "zmq")

WITHOUT_EXTRAS = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked: a plain install lacks it)", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    import numpy as np

    import mooncake.cache, mooncake.sched, mooncake.workload
    from mooncake.cache import BlockHasher, BlockIndex, BlockStored
    from mooncake.cache._compiled import is_compiled, use_compiled
    from mooncake.errors import ConfigError
    from mooncake.types import InstanceId, Tier

    hasher = BlockHasher(model="m", block_size_tokens=4, seed=3)
    tokens = np.arange(40, dtype=np.int32) * 7919 % 50021
    keys = hasher.block_keys(tokens)
    batch = hasher.hash_batch(tokens, [0, 9, 9, 40])
    index = BlockIndex()
    index.apply(BlockStored(source=InstanceId("a"), seq=0, keys=keys[:6], tier=Tier.DRAM))
    index.apply(BlockStored(source=InstanceId("b"), seq=0, keys=keys[:3], tier=Tier.VRAM))
    index.check_invariants()
    try:
        use_compiled(True)
        refused = False
    except ConfigError:
        refused = True
    from mooncake.cache import BlockStored
    from mooncake.sched import HARDWARE, MODELS, build_conductor
    from mooncake.types import InstanceId, Request, RequestId, Tier

    conductor = build_conductor(
        model=MODELS["llama3-70b"], hardware=HARDWARE["8xA800"], prefill_instances=["a", "b"],
        decode_instances=["d"], hasher=hasher,
    )
    for instance, held in (("a", keys[:6]), ("b", keys[:3])):
        conductor.apply_cache_event(BlockStored(source=InstanceId(instance), seq=0, keys=held, tier=Tier.DRAM))
    decisions = []
    for n in range(3):  # the second and third queue behind the first: its blocks count as coming
        request = Request(request_id=RequestId(str(n)), arrival_s=0.0, input_length=40, output_length=8,
                          block_keys=keys, block_size_tokens=4)
        decision = conductor.schedule(request, 0.0)
        decisions.append([decision.accepted, decision.prefill_instance, decision.decode_instance,
                          decision.prefix_tokens])
    conductor.check_invariants()
    print(json.dumps({
        "keys": [str(k) for k in keys],
        "batch": [str(k) for k in batch.keys.tolist()],
        "lengths": dict(index.match(keys).lengths),
        "compiled": is_compiled() or hasher.is_compiled,
        "refused": refused,
        "decisions": decisions,
        "loaded": sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED),
    }))
    """
)


def test_core_imports_without_extras() -> None:
    """With no extra installed (torch, numba, aiohttp, ray, ... unimportable), `mooncake.sched`, `mooncake.cache`
    and `mooncake.workload` import, and the hasher, the index and a Conductor (its scans and pending blocks
    on the plain path) give the same keys, answers and decisions as here."""
    script = f"BLOCKED = {set(EXTRA_PACKAGES)!r}\n{WITHOUT_EXTRAS}"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain = json.loads(done.stdout)
    assert plain["compiled"] is False and plain["refused"] is True
    assert plain["loaded"] == []

    from mooncake.cache import BlockHasher

    hasher = BlockHasher(model="m", block_size_tokens=4, seed=3)
    tokens = np.arange(40, dtype=np.int32) * 7919 % 50021
    keys = hasher.block_keys(tokens)
    assert plain["keys"] == [str(k) for k in keys]
    assert plain["batch"] == [str(k) for k in hasher.hash_batch(tokens, [0, 9, 9, 40]).keys.tolist()]
    assert plain["lengths"] == {"a": 6, "b": 3}
    # The Conductor schedules without numba (its scans and pending blocks on the plain path) as it does here.
    from mooncake.cache import BlockStored
    from mooncake.sched import HARDWARE, MODELS, build_conductor
    from mooncake.types import InstanceId, Request, RequestId, Tier

    conductor = build_conductor(
        model=MODELS["llama3-70b"],
        hardware=HARDWARE["8xA800"],
        prefill_instances=["a", "b"],
        decode_instances=["d"],
        hasher=hasher,
    )
    for instance, held in (("a", keys[:6]), ("b", keys[:3])):
        conductor.apply_cache_event(BlockStored(source=InstanceId(instance), seq=0, keys=held, tier=Tier.DRAM))
    decisions = []
    for n in range(3):
        request = Request(
            request_id=RequestId(str(n)),
            arrival_s=0.0,
            input_length=40,
            output_length=8,
            block_keys=keys,
            block_size_tokens=4,
        )
        decision = conductor.schedule(request, 0.0)
        decisions.append(
            [decision.accepted, decision.prefill_instance, decision.decode_instance, decision.prefix_tokens]
        )
    assert plain["decisions"] == decisions


def top_level_imports(module: str) -> set[str]:
    path = ROOT.joinpath(*module.split(".")[1:])
    source = (path / "__init__.py") if path.is_dir() else path.with_suffix(".py")
    found = set()
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("module", module_names())
def test_only_the_engine_imports_torch_at_module_level(module: str) -> None:
    """torch is imported at module level only inside `mooncake.engine` (STYLE.md: the only torch users)."""
    if not module.startswith("mooncake.engine"):
        assert "torch" not in top_level_imports(module), f"{module} imports torch at module level"


@pytest.mark.parametrize("module", [m for m in module_names() if m.startswith("mooncake.sim")])
def test_simulator_never_imports_torch(module: str) -> None:
    """No module of `mooncake.sim` imports torch, at any level: the simulator runs where torch is absent."""
    path = ROOT.joinpath(*module.split(".")[1:])
    source = (path / "__init__.py") if path.is_dir() else path.with_suffix(".py")
    for node in ast.walk(ast.parse(source.read_text())):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        assert not any(name == "torch" or name.startswith("torch.") for name in names), f"{module} imports torch"


def test_simulator_import_is_light() -> None:
    """The whole simulator and its reports load without torch: importing them does not load it."""
    script = (
        "import sys, mooncake.sim.disaggregated, mooncake.sim.coupled, mooncake.sim.report; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("module", [m for m in module_names() if not m.rsplit(".", 1)[-1].startswith("_")])
def test_public_modules_declare_a_sorted_all(module: str) -> None:
    """Every public module has a sorted `__all__` of names it defines."""
    imported = importlib.import_module(module)
    names = getattr(imported, "__all__", None)
    assert names is not None, f"{module} has no __all__"
    assert list(names) == sorted(names), f"{module}.__all__ is not sorted"
    for name in names:
        assert hasattr(imported, name), f"{module}.__all__ names missing {name}"


def test_package_is_typed() -> None:
    """The package ships its py.typed marker."""
    assert (ROOT / "py.typed").exists()
