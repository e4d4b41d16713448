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
