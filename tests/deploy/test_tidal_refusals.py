"""Day/night refuses what it cannot do before it changes anything (no cluster needed)."""

from __future__ import annotations

import pytest


def test_a_pd_app_is_not_lent_at_night():
    from deploy.tidal import lend_nodes

    with pytest.raises(ValueError, match="P/D app"):
        lend_nodes({"replicas": 2, "decode_replicas": 1}, 1)
