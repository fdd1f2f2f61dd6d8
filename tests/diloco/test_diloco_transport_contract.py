"""The transport contract, run against the in-memory test double (so the double used by the
coordinator tests behaves like a real store)."""

from __future__ import annotations

import pytest
from diloco_fakes import MemoryTransport
from transport_contract import TransportContract


class TestMemoryTransportContract(TransportContract):
    @pytest.fixture
    def transport(self) -> MemoryTransport:
        return MemoryTransport()
