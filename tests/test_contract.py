"""The family contract (`jaxembed.models.Family`) and the explicit runtime: every family states
every member, a family missing one is refused by name, and no backend is module-global state."""

from __future__ import annotations

import types

import pytest

from jaxembed import kernels, models


@pytest.mark.parametrize("name", models.names())
def test_every_family_states_the_whole_contract(name):
    module = models.by_name(name)
    assert module.Config.architecture == name
    assert isinstance(module.VERTICAL, bool)
    assert isinstance(module.FLOAT32_PARAMS, tuple) and isinstance(module.LINEAR_PARAMS, tuple)
    annotated = set(models.Family.__annotations__) | {
        m for m in vars(models.Family) if not m.startswith("_") and callable(getattr(models.Family, m))}
    assert annotated <= set(dir(module)), annotated - set(dir(module))


def test_a_family_missing_a_member_is_refused(monkeypatch):
    broken = types.ModuleType("jaxembed.models.broken")
    monkeypatch.setitem(models._FAMILIES, "broken", models.Registration("jaxembed.models.broken", "", None))
    monkeypatch.setitem(__import__("sys").modules, "jaxembed.models.broken", broken)
    with pytest.raises(TypeError, match=r"lacks \['Config', 'VERTICAL'"):
        models.by_name("broken")


def test_no_module_global_backend_state():
    """The dispatch keeps no stack or default: `use()` is gone and every operator needs `backend=`."""
    assert not hasattr(kernels, "use") and not hasattr(kernels, "_stack")
    import inspect

    for op in (kernels.ssd_chunked, kernels.ssd_chunked_xbc, kernels.wkv7_chunked, kernels.mlstm_chunked):
        param = inspect.signature(op).parameters["backend"]
        assert param.default is inspect.Parameter.empty and param.kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("name", models.names())
def test_the_registry_names_each_familys_conversion_and_operator(name):
    from jaxembed.kernels import common

    reg = models.registration(name)
    layouts = __import__("importlib").import_module(reg.conversion)
    assert all(hasattr(layouts, m) for m in ("detect", "rules_for", "ignored_keys", "RENAMES", "EXPECTS", "reference"))
    assert reg.operator is None or reg.operator in common._TILES
    assert (reg.operator is None) == (not models.by_name(name).VERTICAL)  # only attention has no chunked operator
