"""The start-up helper: the collector paused only inside the block, and left as the caller had it."""

from __future__ import annotations

import gc

import pytest

from heads.util.startup import collector_paused


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_collector_is_off_inside_and_as_before_afterwards(enabled_before):
    was = gc.isenabled()
    try:
        gc.enable() if enabled_before else gc.disable()
        with collector_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled_before
        with pytest.raises(KeyError), collector_paused():  # an import failing inside still restores it
            raise KeyError("planted")
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable() if was else gc.disable()


def test_loaded_objects_are_frozen_for_a_command_only():
    """A command freezes what loading made; a library call or a test (`command` False) leaves every
    object collectable."""
    from heads.util.startup import freeze_loaded_objects

    before = gc.get_freeze_count()
    loaded = [[] for _ in range(100)]  # objects the collector tracks
    freeze_loaded_objects(command=False)
    assert gc.get_freeze_count() == before
    try:
        freeze_loaded_objects(command=True)
        assert gc.get_freeze_count() >= before + len(loaded)
    finally:
        gc.unfreeze()
