"""zbpipe.patching: every patch can be undone, and undo never clobbers a later patch."""

import sys
import types

from zbpipe.patching import modules_holding, patch, rebind, undo_all, wrap


class Stage:
    def forward(self, x):
        return x + 1


def test_wrapping_an_instance_method_and_undoing_restores_the_class_method():
    stage = Stage()
    p = wrap(stage, "forward", lambda fwd: lambda x: 10 * fwd(x))
    assert stage.forward(1) == 20
    assert p.undo()
    assert stage.forward(1) == 2 and "forward" not in vars(stage)


def test_undo_leaves_a_later_patch_alone_and_undo_all_unwinds_in_order():
    stage = Stage()
    first = wrap(stage, "forward", lambda fwd: lambda x: fwd(x) * 2)
    second = wrap(stage, "forward", lambda fwd: lambda x: fwd(x) * 3)
    assert stage.forward(0) == 6
    assert not first.undo()  # the second patch sits on top: nothing happens
    assert stage.forward(0) == 6
    undo_all([first, second])
    assert stage.forward(0) == 1 and "forward" not in vars(stage)


def test_rebind_reaches_every_module_that_imported_the_name_and_undoes():
    def original():
        return "original"

    def replacement():
        return "replacement"

    mods = [types.ModuleType(f"_zbpipe_patch_test_{i}") for i in range(2)]
    try:
        for m in mods:
            m.fn = original
            sys.modules[m.__name__] = m
        patches = rebind("fn", original, replacement)
        assert {p.target for p in patches} == set(mods)
        assert all(m.fn() == "replacement" for m in mods)
        assert modules_holding("fn", original) == []
        undo_all(patches)
        assert all(m.fn is original for m in mods)
    finally:
        for m in mods:
            sys.modules.pop(m.__name__, None)


def test_patch_of_an_own_attribute_restores_the_value():
    ns = types.SimpleNamespace(value=1)
    p = patch(ns, "value", 2)
    assert ns.value == 2 and p.undo() and ns.value == 1
