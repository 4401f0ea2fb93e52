"""The workspace itself: every package imports, and shared files are where the setting says."""

import importlib

import pytest

PACKAGES = [
    "rewards_math",
    "rl_algos",
    "vlm_data",
    "vlm_models",
    "rollout_sglang",
    "trainers_fsdp",
    "trainers_megatron",
    "rl_runtime",
    "weight_sync",
]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_imports(name: str) -> None:
    assert importlib.import_module(name).__name__ == name


def test_shared_files_present(geo3k_dir, qwen3vl_dir) -> None:
    assert (geo3k_dir / "validation.parquet").is_file()
    assert (qwen3vl_dir / "vocab.json").is_file()


@pytest.mark.parametrize("name", PACKAGES)
def test_exported_names_are_not_shadowed_by_modules(name: str) -> None:
    """Importing a submodule sets the package attribute of its name: an exported function of
    the same name (`rl_runtime.layout`, a module `layout.py`) would turn into that module."""
    import inspect
    import pkgutil

    package = importlib.import_module(name)
    exported = {export: getattr(package, export) for export in package.__all__}
    modules = {m.name for m in pkgutil.iter_modules(package.__path__) if not m.ispkg}
    for module in sorted(modules):
        importlib.import_module(f"{name}.{module}")
    for export, value in exported.items():
        now = getattr(package, export)
        assert now is value or not inspect.ismodule(now), f"{name}.{export} became a module"
